// lowp.cuh - bf16 and int8 weights widened to float in registers: the one place the course does it
// (step4_gpt2/gemv_lowp.cu's GEMVs and the megakernel's GEMV tiles both read their weights through it).
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
