// stats_kernel.h compiled for AVX-512 F/BW/VL/DQ (512-bit lanes) + FMA + F16C. Chosen at run
// time by tensor_stats.cpp on processors that have all four.
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define FH_ISA_NS avx512
#define FH_ISA_AVX512 1
#include "stats_kernel.h"
#endif
