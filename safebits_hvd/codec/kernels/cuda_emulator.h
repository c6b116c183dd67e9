/* A CPU emulation of the few CUDA features cuda_kernels.cu uses, so that the exact CUDA translation unit
 * (cuda.cuda_source()) compiles as C++ and its kernels run on the host: one block at a time, its SB_THREADS threads
 * as cooperative fibers (ucontext) that switch only at __syncthreads, so a block's __shared__ variables can be
 * statics and atomics plain read-modify-writes. Floating point is IEEE as under the NVRTC options of cuda.py (no
 * FMA: -ffp-contract=off; SSE arithmetic; correctly rounded division and sqrt), so results are the GPU's bit for bit
 * where the kernels' order of operations fixes them (docs/DESIGN.md, "Host and device"). Used by
 * safebits_hvd/codec/kernels/cuda_emulator.py; slow (a context switch per thread per barrier): for tests on small inputs. */
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <ucontext.h>

using std::isfinite; /* CUDA's math functions are global: the kernels call them unqualified */
using std::isinf;
using std::isnan;

#define __CUDACC_RTC__ 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
#define __constant__

struct sb_emu_dim3 {
    unsigned x, y, z;
};
static sb_emu_dim3 threadIdx, blockIdx, blockDim, gridDim;

struct uint4 {
    unsigned x, y, z, w;
};
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

static inline unsigned __float_as_uint(float x) {
    unsigned u;
    std::memcpy(&u, &x, sizeof u);
    return u;
}
static inline float __uint_as_float(unsigned u) {
    float x;
    std::memcpy(&x, &u, sizeof x);
    return x;
}
static inline double __longlong_as_double(long long v) {
    double d;
    std::memcpy(&d, &v, sizeof d);
    return d;
}
static inline float __fdiv_rn(float a, float b) { return a / b; }

/* Fibers never run at the same time: an atomic is a plain read-modify-write. */
template <class T> static inline T atomicAdd(T *p, T v) { T old = *p; *p = old + v; return old; }
template <class T> static inline T atomicOr(T *p, T v) { T old = *p; *p = old | v; return old; }
template <class T> static inline T atomicMin(T *p, T v) { T old = *p; *p = v < old ? v : old; return old; }
template <class T> static inline T atomicMax(T *p, T v) { T old = *p; *p = v > old ? v : old; return old; }

/* The block's threads. */
enum { SB_EMU_THREADS = 256, SB_EMU_STACK = 1 << 16 };
static ucontext_t sb_emu_scheduler, sb_emu_fiber[SB_EMU_THREADS];
static char *sb_emu_stack[SB_EMU_THREADS];
static int sb_emu_done[SB_EMU_THREADS];
static int sb_emu_current;
static std::function<void()> sb_emu_body;

static void __syncthreads() { swapcontext(&sb_emu_fiber[sb_emu_current], &sb_emu_scheduler); }

static int __syncthreads_or(int predicate) {
    static int any;
    __syncthreads();
    if (threadIdx.x == 0) any = 0;
    __syncthreads();
    if (predicate) any = 1;
    __syncthreads();
    return any;
}

static void sb_emu_fiber_main(int t) {
    sb_emu_body();
    sb_emu_done[t] = 1; /* returning switches to uc_link: the scheduler */
}

/* Run body as `grid` blocks of SB_EMU_THREADS threads, block after block; a block's threads run until each has
 * reached the same barrier (or returned) before any goes past it. */
static void sb_emu_run(long long grid, std::function<void()> body) {
    sb_emu_body = std::move(body);
    blockDim = sb_emu_dim3{SB_EMU_THREADS, 1, 1};
    gridDim = sb_emu_dim3{(unsigned)grid, 1, 1};
    for (int t = 0; t < SB_EMU_THREADS; t++)
        if (!sb_emu_stack[t]) sb_emu_stack[t] = (char *)std::malloc(SB_EMU_STACK);
    for (long long b = 0; b < grid; b++) {
        blockIdx = sb_emu_dim3{(unsigned)b, 0, 0};
        for (int t = 0; t < SB_EMU_THREADS; t++) {
            getcontext(&sb_emu_fiber[t]);
            sb_emu_fiber[t].uc_stack.ss_sp = sb_emu_stack[t];
            sb_emu_fiber[t].uc_stack.ss_size = SB_EMU_STACK;
            sb_emu_fiber[t].uc_link = &sb_emu_scheduler;
            makecontext(&sb_emu_fiber[t], (void (*)())sb_emu_fiber_main, 1, t);
            sb_emu_done[t] = 0;
        }
        for (int live = SB_EMU_THREADS; live;) {
            live = 0;
            for (int t = 0; t < SB_EMU_THREADS; t++) {
                if (sb_emu_done[t]) continue;
                sb_emu_current = t;
                threadIdx = sb_emu_dim3{(unsigned)t, 0, 0};
                swapcontext(&sb_emu_scheduler, &sb_emu_fiber[t]);
                live += !sb_emu_done[t];
            }
        }
    }
}
