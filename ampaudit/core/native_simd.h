/* Shared by ampaudit's C sources (core/native.py compiles each with -I pointing here): each hot
 * loop is compiled three times - for AVX-512 (x86-64-v4), AVX2 (x86-64-v3) and the baseline -
 * and the loader picks the best the CPU has (GCC/clang function multiversioning): the wider
 * vectors halve the time of float32 and bfloat16 loops, and a build stays portable.
 * core/native.py builds with -DAMPAUDIT_NO_CLONES where the toolchain cannot. */
#ifndef AMPAUDIT_NATIVE_SIMD_H
#define AMPAUDIT_NATIVE_SIMD_H

#if defined(__x86_64__) && defined(__has_attribute) && !defined(AMPAUDIT_NO_CLONES)
#if __has_attribute(target_clones)
#define SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#endif
#ifndef SIMD_CLONES
#define SIMD_CLONES
#endif

#endif
