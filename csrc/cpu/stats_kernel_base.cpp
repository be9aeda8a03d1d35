// stats_kernel.h compiled for the build's baseline instruction set: the portable fallback
// (SSE2 on x86-64, NEON on arm64), and the one tests force with FASTHEALTH_CPU_ISA=base.
#define FH_ISA_NS base
#include "stats_kernel.h"
