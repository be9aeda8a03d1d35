// stats_kernel.h compiled for AVX + FMA + F16C (every x86-64 CPU since 2013; AVX2 is not
// required, since some virtual machines hide it). Chosen at run time by tensor_stats.cpp.
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx,fma,f16c")
#define FH_ISA_NS avx
#define FH_ISA_AVX 1
#include "stats_kernel.h"
#endif
