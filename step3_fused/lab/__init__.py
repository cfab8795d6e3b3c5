"""Step 3's lab: experiments around the lesson's code, kept out of the modules the notebooks teach from.
Each module here wraps the mainline (step3_fused.ops, step3_fused.training); nothing of the mainline imports it.

    per_sample.py   the training loop at one sample per step (B = 1), the launch-bound baseline of 03b's
                    "batched vs one sample per step" comparison, as a whole training run
"""
