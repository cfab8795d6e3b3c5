"""Planted bugs of the exercises of lessons 2c and 4c (Exercise 2c.1 `step2/mma_tile`, Exercise 4c.1
`step4/handoff`), in the form of tests/exercise_bugs/__init__.py: edits of the solution, each of which the
checker must report as FAIL on a GPU. Every one fails the same cases on every run: the handoff's bugs show in
the case without producers, where nothing races."""

BUGS = {
    "step2/mma_tile": [
        ("a1_a2_swapped", "a[1] and a[2] swapped: rows g+8 taken for columns 2t+8 and the other way round",
         "                                pack(A[(g + 8) * K + k], A[(g + 8) * K + k + 1]),\n"
         "                                pack(A[g * K + k + 8], A[g * K + k + 9]),\n",
         "                                pack(A[g * K + k + 8], A[g * K + k + 9]),\n"
         "                                pack(A[(g + 8) * K + k], A[(g + 8) * K + k + 1]),\n"),
        ("halves_swapped", "pack(hi, lo): the higher column in the low half of a[0]",
         "{pack(A[g * K + k], A[g * K + k + 1]),", "{pack(A[g * K + k + 1], A[g * K + k]),"),
        ("b_along_a_row", "b[0] read along a row of B, as if B were stored transposed (8 x K)",
         "const unsigned b0 = pack(B[k * 8 + g], B[(k + 1) * 8 + g]);",
         "const unsigned b0 = pack(B[g * K + k], B[g * K + k + 1]);"),
        ("no_accumulation", "d cleared at every k-step: only the last 16 values of K count (K = 16 still passes)",
         "        const int k = k0 + 2 * t;\n",
         "        const int k = k0 + 2 * t;\n        d[0] = d[1] = d[2] = d[3] = 0.0f;\n"),
    ],
    "step4/handoff": [
        ("give_up_not_reported", "the spin gives up, but the status says 0 (received): the host never learns",
         "status[p] = ok ? 0 : 1;", "status[p] = 0;"),
        ("copies_after_give_up", "a consumer that gave up copies the payload anyway (here: what was never written)",
         "    if (!ok) return;                                       // gave up: the payload may not be there\n", ""),
    ],
}
