"""Step 4's tests: GPT-2 inference (4a), training (4b) and the megakernel (4c), each with its lab's tests."""
