// lowp.cuh - bf16 and int8 weights widened to float in registers (or int8 to fp16 tensor-core operands): the one
// place the course does it (step4_gpt2/gemv_lowp.cu's GEMVs and the megakernel's GEMV tiles both read their
// weights through it); and the way back, fp32 rounded to bf16 bits, shared by mixed.cu's casts and the kernels
// that replaced a cast (step4_gpt2/train: train_gpt2.cu's LayerNorm forward and backward and GELU backward,
// attention_bf16.cu's dqkv16), so that a value fused into the kernel that makes it gets the bits a separate cast
// would have given it.
//
// A weight is stored in fewer bytes and computed with in fp32: the load brings 8 (bf16) or 16 (int8) weights in
// 16 bytes, and each is widened after the load, where it costs instructions but no bandwidth. The widening must
// be cheap enough not to become the limit once the bytes are few: a shift for bf16, a byte permute and an FADD
// for int8 (no int -> float conversion instruction, which runs at a quarter of the FMA rate on recent GPUs).
#pragma once

// Word i of a 16-byte load (i is a compile-time constant once the caller's loops are unrolled).
__device__ __forceinline__ unsigned word(const uint4& u, int i) {
    return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w;
}

// Four bf16 weights (two per word, little-endian: the low half is the earlier weight) as floats, exactly: a
// bf16 is the top half of a float32, so widening it is a shift (plain integer work, on every GPU the course
// supports; no sm_80 instruction).
__device__ __forceinline__ float bf16_to_float(unsigned short h) { return __uint_as_float((unsigned)h << 16); }
__device__ __forceinline__ float4 bf16x4_to_float4(unsigned a, unsigned b) {
    return make_float4(__uint_as_float(a << 16), __uint_as_float(a & 0xffff0000u),
                       __uint_as_float(b << 16), __uint_as_float(b & 0xffff0000u));
}

// Four int8 weights (the bytes of a, lowest first) as floats, exactly, with no int -> float conversion.
// a ^ 0x80808080 flips each byte's sign bit: byte q becomes q + 128 as an unsigned byte (0..255). Byte
// permute i builds the word {that byte, 0x00, 0x00, 0x4B}: the float 2^23 + q + 128 (exponent 2^23, the byte
// in the lowest mantissa bits). Subtracting 2^23 + 128 = 8388736 is exact: both are integers below 2^24.
// __byte_perm(x, y, s): result byte n = byte s[4n+2 : 4n] of the 8 bytes {y, x} (x's bytes are 0-3, y's 4-7);
// here selector 0x754i takes x's byte i, then y's bytes 0, 1 (zeros) and 3 (0x4B).
#define I8_MAGIC 0x4B000000u            // the float 2^23
#define I8_OFFSET 8388736.0f            // 2^23 + 128
__device__ __forceinline__ float4 i8x4_to_float4(unsigned a) {
    const unsigned b = a ^ 0x80808080u;
    return make_float4(__uint_as_float(__byte_perm(b, I8_MAGIC, 0x7540)) - I8_OFFSET,
                       __uint_as_float(__byte_perm(b, I8_MAGIC, 0x7541)) - I8_OFFSET,
                       __uint_as_float(__byte_perm(b, I8_MAGIC, 0x7542)) - I8_OFFSET,
                       __uint_as_float(__byte_perm(b, I8_MAGIC, 0x7543)) - I8_OFFSET);
}

// Two int8 weights (bytes 2i, 2i+1 of word v: high = false takes bytes 0, 1) as the two fp16 halves of one
// register, the earlier weight in the low half, exactly: the same byte flip as above puts q + 128 into the low
// mantissa byte of the fp16 1024 (byte permute with 0x64, fp16 0x64hh = 1024 + hh), and one half2 subtract of
// 1152 leaves q (fp16 holds every integer up to 2048). gemv_lowp.cu's v9 feeds the result to mma.sync.
__device__ __forceinline__ unsigned i8x2_to_half2(unsigned v, bool high) {
    const unsigned h = __byte_perm(v ^ 0x80808080u, 0x64646464u, high ? 0x5342 : 0x5140);   // 1024 + q + 128
    unsigned r;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(h), "r"(0x64806480u));                     // - 1152
    return r;
}

// fp32 -> bf16 bits, round to nearest even: add 0x7fff plus the lowest kept bit, keep the top 16 bits. A NaN
// would round into the sign bit or to infinity: it is made the quiet NaN instead. Integer work only, so it
// compiles for every architecture the course supports (cvt.rn.bf16x2.f32 needs sm_80).
__device__ __forceinline__ unsigned short bf16_bits(float x) {
    const unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0;
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Two or four bf16 bit patterns in one 4- or 8-byte store, the earlier column in the low half (bf16x4_to_float4's
// order, and the memory order of a uint16 array on a little-endian GPU).
__device__ __forceinline__ unsigned bf16x2_bits(float lo, float hi) {
    return bf16_bits(lo) | ((unsigned)bf16_bits(hi) << 16);
}
__device__ __forceinline__ uint2 bf16x4_bits(float a, float b, float c, float d) {
    return make_uint2(bf16x2_bits(a, b), bf16x2_bits(c, d));
}
__device__ __forceinline__ uint2 bf16x4_bits(float4 v) { return bf16x4_bits(v.x, v.y, v.z, v.w); }
