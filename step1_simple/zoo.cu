// zoo.cu - a small zoo of elementwise kernels, one line of math each, all on one grid-stride pattern.
//
// Once the pattern of axpb_v2 is right (global index, grid-stride loop, bounds), a new elementwise op
// is just a new expression. The macros below stamp out one kernel per op so that the pattern is
// written once; each kernel is extern "C" so Python finds it by its plain name (zoo_<op>).
//
//   unary   zoo_relu zoo_sigmoid zoo_tanh zoo_gelu zoo_exp zoo_log zoo_copy     out = f(a)
//   binary  zoo_add zoo_sub zoo_mul zoo_div zoo_pow zoo_relu_backward          out = f(a, b)
//   scalar  zoo_add_scalar zoo_mul_scalar                                       out = f(a, s)
//   fill    zoo_fill                                                            out = s
//
// relu_backward takes (grad, x): the gradient flows where the forward input was positive.
#include "course.cuh"

#define GRID_STRIDE(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (long long)gridDim.x * blockDim.x)

#define UNARY(name, expr)                                                                      \
    extern "C" __global__ void zoo_##name(const float* __restrict__ a, float* __restrict__ out, \
                                          long long n) {                                       \
        GRID_STRIDE(i, n) { const float x = a[i]; out[i] = (expr); }                           \
    }

#define BINARY(name, expr)                                                                     \
    extern "C" __global__ void zoo_##name(const float* __restrict__ a, const float* __restrict__ b, \
                                          float* __restrict__ out, long long n) {              \
        GRID_STRIDE(i, n) { const float x = a[i], y = b[i]; out[i] = (expr); }                 \
    }

#define SCALAR(name, expr)                                                                     \
    extern "C" __global__ void zoo_##name(const float* __restrict__ a, float s,                \
                                          float* __restrict__ out, long long n) {              \
        GRID_STRIDE(i, n) { const float x = a[i]; out[i] = (expr); }                           \
    }

UNARY(relu, fmaxf(x, 0.0f))
UNARY(sigmoid, 1.0f / (1.0f + expf(-x)))
UNARY(tanh, tanhf(x))
UNARY(gelu, gelu_tanh(x))
UNARY(exp, expf(x))
UNARY(log, logf(x))
UNARY(copy, x)

BINARY(add, x + y)
BINARY(sub, x - y)
BINARY(mul, x * y)
BINARY(div, x / y)
BINARY(pow, powf(x, y))
BINARY(relu_backward, y > 0.0f ? x : 0.0f)

SCALAR(add_scalar, x + s)
SCALAR(mul_scalar, x * s)

extern "C" __global__ void zoo_fill(float s, float* __restrict__ out, long long n) {
    GRID_STRIDE(i, n) out[i] = s;
}
