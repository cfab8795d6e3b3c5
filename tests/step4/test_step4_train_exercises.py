"""Lesson 4b's kernel exercises (step4_gpt2/train/exercises/): what tests/test_exercises.py does not already check
for every registered exercise (compiling stub, solution and planted bugs for every architecture; on a GPU the stub
FAILs, the solution PASSes, every planted bug FAILs). Here: the stubs carry their hint levels, every case's inputs
and float64 reference are well formed, the swaps replace ops the trainer really calls; on a GPU the solution
passes the training run too, and the training-run comparison alone catches a wrong kernel."""
import inspect
import os

import numpy as np
import pytest

from common import exercises as E
from common.kernels import ARCHS, ROOT, compile_offline, supported_archs
from step4_gpt2.train import exercises as X
from tests.exercise_bugs import bugged_copy as _bugged
from tests.exercise_bugs.step4_train import BUGS

IDS = [ex.id for ex in X.EXERCISES]
BUG_CASES = [(i, b[0]) for i in IDS for b in BUGS[i]]
gpu = pytest.mark.gpu


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    """The exercises in common.exercises' registry (common.exercises.STEP_PACKAGES lists the package; until it
    does, they are added for these tests)."""
    reg = E.registry()
    for ex in X.EXERCISES:
        if ex.id not in reg:
            monkeypatch.setitem(reg, ex.id, ex)


# ------------------------------------------------------------------------------------------- CPU
def test_lesson_4b_has_its_exercises():
    assert len(IDS) >= 2 and len(set(IDS)) == len(IDS)
    for ex in X.EXERCISES:
        assert ex.id.startswith("step4/") and ex.stub.startswith(X.HERE + "/"), ex.id
        stub = (ROOT / ex.stub).read_text()
        assert (ROOT / ex.solution).is_file(), ex.id
        assert "TODO" in stub and f'check("{ex.id}")' in stub, ex.id
        i1, i2, i3 = stub.find("// Hint 1"), stub.find("// Hint 2"), stub.find(f'solution("{ex.id}")')
        assert 0 < i1 < i2 < i3, f"{ex.id}: the header needs Hint 1, then Hint 2, then the solution line"
        assert BUGS[ex.id], ex.id
        assert ex.model is not None and ex.speed is not None and ex.speed.course is not None, ex.id
    names = {f.name for f in (ROOT / "step4_gpt2" / "exercises").glob("*.cu")}
    assert not names & {(ROOT / ex.stub).name for ex in X.EXERCISES}, \
        "a 4b stub named like a 4a one would share the learner's my_exercises/step4/ file"


@pytest.mark.parametrize("ex_id", IDS)
def test_cases_and_references_are_well_formed(ex_id):
    ex = E.exercise(ex_id)
    names = [n for n, _ in ex.cases]
    assert len(set(names)) == len(names)
    for name, params in ex.cases + (("speed", ex.speed.params),):
        host = ex.make(params, np.random.default_rng(0))
        for out in ex.outputs:
            assert out in host, (name, out)
        if name == "speed":
            continue
        ref = ex.reference({k: v for k, v in host.items() if not isinstance(v, E.Out)})
        for out in ex.outputs:
            shape = host[out].shape
            assert ref[out].shape == tuple(shape) and np.isfinite(ref[out]).all(), (name, out)


def test_layernorm_partials_add_up_to_the_parameter_gradients():
    ex = E.exercise("step4/layernorm_backward")
    host = ex.make({"N": 77, "C": 45}, np.random.default_rng(1))
    ref = ex.reference({k: v for k, v in host.items() if not isinstance(v, E.Out)})
    from common.reference import train_gpt2 as R
    _, dw, db = R.layernorm_backward(host["dy"], host["x"], host["w"], host["mean"], host["rstd"])
    np.testing.assert_allclose(ref["partial"].sum(0), np.concatenate([dw, db]), rtol=1e-12, atol=1e-12)
    assert ref["partial"].shape == (-(-77 // X.LN_ROWS), 90)


@pytest.mark.parametrize("ex_id", IDS)
def test_the_swap_replaces_an_op_the_trainer_calls(ex_id):
    from step4_gpt2.train import model, ops
    name, replacement = X.swap(ex_id, lambda kernel_name: None)
    course = getattr(ops, name)
    assert list(inspect.signature(replacement).parameters) == list(inspect.signature(course).parameters)
    assert f"ops.{name}(" in inspect.getsource(model.TrainGPT.backward), \
        f"TrainGPT.backward must call ops.{name} through the module, or the swap does not reach it"


def test_check_without_gpu_compiles_the_stub(tmp_path, monkeypatch, capsys):
    from common.device import gpu_available
    if gpu_available():
        pytest.skip("this machine has a GPU: the offline path is not taken")
    monkeypatch.setenv("COURSE_EXERCISES_DIR", str(tmp_path / "mine"))
    path = E.start("step4/layernorm_backward")
    assert path == tmp_path / "mine" / "step4" / "layernorm_backward.cu"
    result = E.check("step4/layernorm_backward")
    assert result.compiled and not result.passed and "needs an NVIDIA GPU" in capsys.readouterr().out


@gpu
@pytest.mark.parametrize("ex_id", IDS)
def test_solution_passes_in_training_too_and_is_timed(ex_id):
    result = E.check(ex_id, path=ROOT / E.exercise(ex_id).solution)
    assert result.passed, [c for c in result.cases if not c.passed]
    assert any("training run" in c.name for c in result.cases)
    assert result.timings["yours"].median_ms > 0 and "course" in result.timings


@gpu
def test_the_course_training_run_is_deterministic():
    """The comparison's tolerances are for two different kernels; the course's own run repeats bit for bit."""
    a, b = X.train_run(steps=5), X.train_run(steps=5)
    assert np.array_equal(a["losses"], b["losses"])
    assert all(np.array_equal(a["grads"][k], b["grads"][k]) for k in a["grads"])
    assert a["calls"] == {"layernorm_backward": 5, "gelu_bias_backward": 2}     # 2 layers: 2L + 1 LayerNorms


@gpu
@pytest.mark.parametrize("ex_id,bug", [("step4/layernorm_backward", "no_accumulate"),
                                       ("step4/gelu_backward", "no_product_rule")])
def test_the_training_comparison_itself_catches_a_wrong_kernel(tmp_path, ex_id, bug):
    """The swap really runs the learner's kernel in the training run: a wrong kernel, given to the run directly
    (not through check, which would stop at its failing cases), changes the first step's gradients. (The
    losses may stay within their tolerance a while: AdamW divides each update by the gradient's own scale.)"""
    from common.kernels import get_kernel
    ex = E.exercise(ex_id)
    path = _bugged(tmp_path, ex_id, bug)
    cases = ex.model(lambda name: get_kernel(path, name, ex.defines))
    assert len(cases) == 2 and not cases[0].passed, cases          # the first step's gradients, at least


@gpu
def test_the_gelu_swap_takes_the_bf16_models_arguments():
    """The bf16 model calls gelu_bias_backward with h in bf16 and asks for dpre's bf16 bits in dpre16: the swap
    widens h for the learner's fp32 kernel and casts its dpre into dpre16. With the solution's kernel, dpre16
    and dbias match the course op's on the same bf16 h (dpre16 within bf16's rounding, dbias fp32-close)."""
    import cupy as cp
    from common import assert_close, poison
    from common.kernels import get_kernel
    from step2_attention.flash import bf16_to_float32
    from step4_gpt2.train import ops
    from step4_gpt2.train.ops_bf16 import to_bf16
    ex = E.exercise("step4/gelu_backward")
    _, swapped = X.swap(ex.id, lambda name: get_kernel(ROOT / ex.solution, name, ex.defines))
    rng = np.random.default_rng(4)
    rows, cols = 37, 133
    dout = cp.asarray(rng.standard_normal((rows, cols)).astype(np.float32) + 0.1)
    h16 = to_bf16(cp.asarray(rng.standard_normal((rows, cols)).astype(np.float32) * 2 + 0.1))
    bias = cp.asarray(rng.standard_normal(cols).astype(np.float32) + 0.1)
    got16, gotb = poison(cp.empty((rows, cols), cp.uint16)), poison(cp.empty(cols, cp.float32))
    got = swapped(dout, h16, bias, dpre16=got16, dbias=gotb)
    assert got[0] is got16 and got[1] is gotb
    want16, wantb = ops.gelu_bias_backward(dout, h16, bias, dpre16=cp.empty((rows, cols), cp.uint16),
                                           dbias=cp.empty(cols, cp.float32))
    assert_close(bf16_to_float32(got16), bf16_to_float32(want16).get(), rtol=1e-2, name="dpre16")
    assert_close(gotb, wantb.get(), rtol=1e-5, name="dbias")


# ------------------------------------------------------------------------------------------- small GPUs
def test_batch_that_fits_halves_until_the_activations_fit(monkeypatch):
    from step4_gpt2.train import train as TR
    cfg = TR.shakespeare_char(65)
    per_seq = TR.activation_bytes(cfg, 1)
    assert TR.activation_bytes(cfg, 64) == 64 * per_seq and per_seq > 4 * 16 * cfg.n_embd * cfg.n_layer * 256
    for left, want in ((10**12, 64), (2 * 64 * per_seq, 64), (2 * 64 * per_seq - 1, 32), (6 << 30, 64),
                       (4 << 30, 32), (2 * 3 * per_seq, 2), (0, 1)):
        monkeypatch.setattr(TR, "memory_left", lambda left=left: left)
        assert TR.batch_that_fits(cfg) == want, (left, want)
    monkeypatch.setattr(TR, "memory_left", lambda: 10**12)
    assert TR.batch_that_fits(cfg, max_batch=48) == 32, "a power of two at most max_batch"


@gpu
def test_activation_bytes_counts_what_the_model_allocates():
    import cupy as cp
    from step4_gpt2.train import model as M, train as TR
    cfg = TR.shakespeare_char(65, block_size=32)
    acts = M._Activations(cfg, 3, 32)
    total = sum(a.nbytes for v in vars(acts).values() for a in (v if isinstance(v, list) else [v])
                if isinstance(a, cp.ndarray))
    assert abs(total - TR.activation_bytes(cfg, 3, 32)) <= 0.01 * total, (total, TR.activation_bytes(cfg, 3, 32))
    assert 0 < TR.memory_left() <= cp.cuda.runtime.memGetInfo()[1]
