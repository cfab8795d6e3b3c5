// scale_clamp_float4.cu - Exercise 1a.3: float4 loads with a scalar head and tail.
//
// Compute, for every i < n:
//
//   y[i] = min(max(a * x[i] + b, lo), hi)
//
// but move the bulk of the data as float4 (16 bytes per load/store instruction). A float4 access must
// start on a 16-byte boundary, and x may be a view that does not (x = buffer[1:], say); the checker
// tries every offset and n that are not multiples of 4. Split the work in three:
//   head   elements 0 .. head-1 one float each: `head` (0..3, and never more than n) is passed in,
//          computed by the caller from x's address; y has the same alignment as x;
//   body   (n - head) / 4 float4s starting at x + head (reinterpret_cast<const float4*>(x + head)),
//          in a grid-stride loop;
//   tail   the last (n - head) % 4 elements, one float each.
// Launch: a fixed grid of 256-thread blocks (grid-stride, as in exercise 2).
// A float4 access to a misaligned address stops the kernel with "misaligned address"; after that
// error the Python process must be restarted (CUDA errors of this kind are sticky).
//
// Hint 1 (where to look): Work out three counts before writing any load: head (given), nvec = (n - head) / 4 float4s,
//   and the tail (n - head) % 4, which starts at head + 4 * nvec. Thread 0 alone can do the head and the tail.
// Hint 2 (the shape of the code): const float4* x4 = reinterpret_cast<const float4*>(x + head), the same for y; a
//   grid-stride loop over nvec loads a float4 v, applies the clamp to v.x, v.y, v.z and v.w and stores it; the head
//   and the tail are one-float loops of at most 3 elements each.
// The solution: solution("step1/scale_clamp_float4") gives its path (read it after trying).
// Check it with: from common.exercises import check; check("step1/scale_clamp_float4")
extern "C" __global__ void scale_clamp_float4(const float* __restrict__ x, float* __restrict__ y,
                                              float a, float b, float lo, float hi, long long n, int head) {
    // TODO: your code here
}
