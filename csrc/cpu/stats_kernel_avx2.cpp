// stats_kernel.h compiled for AVX2 + FMA + F16C (256-bit lanes, with AVX2's integer shifts for
// bfloat16). Chosen at run time by tensor_stats.cpp.
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx2,fma,f16c")
#define FH_ISA_NS avx2
#define FH_ISA_AVX 1
#define FH_ISA_AVX2 1
#include "stats_kernel.h"
#endif
