"""The float64 references are checked against independent formulas (loops, identities, known values)."""
import math

import numpy as np
import pytest

from common import reference as R, rand


def test_gelu_matches_scalar_formula_and_grad_matches_finite_difference():
    x = rand(257, dtype=np.float64, seed=0, low=-5, high=5)
    want = [0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3))) for v in x]
    np.testing.assert_allclose(R.gelu(x), want, rtol=1e-12, atol=1e-14)
    h = 1e-6
    np.testing.assert_allclose(R.gelu_grad(x), (R.gelu(x + h) - R.gelu(x - h)) / (2 * h), rtol=1e-6, atol=1e-9)


def test_zoo_table_is_complete():
    assert set(R.ZOO) >= {"add", "sub", "mul", "div", "relu", "relu_backward", "sigmoid", "tanh", "gelu",
                          "exp", "log", "pow", "add_scalar", "mul_scalar", "fill", "copy"}
    x = np.array([-2.0, 0.5]); g = np.array([3.0, 4.0])
    np.testing.assert_array_equal(R.relu_backward(g, x), [0.0, 4.0])


def test_softmax_rows_sum_to_one_and_handle_masks_and_large_values():
    x = rand(5, 33, dtype=np.float64, seed=1, low=-1e3, high=1e3)
    x[1, ::2] = -np.inf
    x[2, :] = -np.inf
    p = R.softmax(x)
    assert np.all(np.isfinite(p))
    np.testing.assert_allclose(p[[0, 1, 3, 4]].sum(-1), 1.0, rtol=1e-12)
    assert np.all(p[1, ::2] == 0) and np.all(p[2] == 0)


def test_attention_matches_a_loop():
    B, H, T, D = 2, 3, 7, 5
    q, k, v = (rand(B, H, T, D, dtype=np.float64, seed=s) for s in (1, 2, 3))
    out = R.attention(q, k, v, causal=True)
    want = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                s = np.array([q[b, h, i] @ k[b, h, j] / math.sqrt(D) for j in range(i + 1)])
                p = np.exp(s - s.max()); p /= p.sum()
                want[b, h, i] = p @ v[b, h, :i + 1]
    np.testing.assert_allclose(out, want, rtol=1e-12)
    assert not np.allclose(R.attention(q, k, v, causal=False), out)


def test_decode_attention_is_the_last_row_of_causal_attention():
    B, H, L, D = 3, 2, 9, 4
    k, v = rand(B, H, L, D, dtype=np.float64, seed=4), rand(B, H, L, D, dtype=np.float64, seed=5)
    q = rand(B, H, D, dtype=np.float64, seed=6)
    lengths = np.array([9, 1, 5])
    out = R.decode_attention(q, k, v, lengths)
    for b, n in enumerate(lengths):
        full = R.attention(q[b][:, None], k[b, :, :n], v[b, :, :n], causal=True)[:, 0]
        np.testing.assert_allclose(out[b], full, rtol=1e-12)


def test_layernorm_normalises_and_residual_variant_adds_first():
    x = rand(4, 37, dtype=np.float64, seed=7, low=-3, high=5)
    y = R.layernorm(x, np.ones(37), np.zeros(37))
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-12)
    np.testing.assert_allclose(y.var(-1), 1, rtol=1e-4)           # eps = 1e-5 shifts it slightly
    p, b = rand(4, 37, dtype=np.float64, seed=8), rand(37, dtype=np.float64, seed=9)
    w, c = rand(37, dtype=np.float64, seed=10), rand(37, dtype=np.float64, seed=11)
    r, ln = R.residual_layernorm(x, p, b, w, c)
    np.testing.assert_allclose(r, x + p + b)
    np.testing.assert_allclose(ln, R.layernorm(x + p + b, w, c))


def test_cross_entropy_matches_log_softmax():
    z = rand(6, 11, dtype=np.float64, seed=12, low=-20, high=20)
    t = np.array([0, 10, 3, 3, 7, 1])
    want = [-math.log(math.exp(z[i, t[i]]) / np.exp(z[i]).sum()) for i in range(6)]
    np.testing.assert_allclose(R.cross_entropy(z, t), want, rtol=1e-10)


def test_sum_and_axpb():
    x = rand(1001, dtype=np.float32, seed=13)
    assert R.sum(x) == pytest.approx(float(np.sum(x.astype(np.float64))))
    np.testing.assert_allclose(R.axpb(x, 2.0, -1.0), 2.0 * x.astype(np.float64) - 1.0)
