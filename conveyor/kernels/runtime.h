// What every kernel source shares besides its arithmetic: bf16 as PyTorch stores it, loops split
// over OpenMP threads as PyTorch's `at::parallel_for` splits them, and the C entry points' error
// reporting. The kernels include no torch or Python headers: they are plain C++ behind a C ABI,
// loaded through ctypes (kernels/native.py), so a build depends on the compiler and the CPU only and
// every environment on a machine shares it (torch's headers took ~20 s of every source's compile).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

#define CONVEYOR_API extern "C" __attribute__((visibility("default")))

namespace conveyor {

// A bf16 value: the high half of an fp32, rounded to nearest even from fp32 (NaN -> 0x7FC0), exactly
// as c10::BFloat16 converts, so a kernel's bf16 output is the bits a PyTorch bf16 op would give.
struct bf16 {
    uint16_t x;
    bf16() = default;
    bf16(float f) : x(from_float(f)) {}  // NOLINT: implicit, as c10::BFloat16's
    operator float() const {             // NOLINT: a 16-bit shift, exact
        const uint32_t u = static_cast<uint32_t>(x) << 16;
        float f;
        std::memcpy(&f, &u, sizeof f);
        return f;
    }
    static uint16_t from_float(float f) {
        if (std::isnan(f)) return 0x7FC0;
        uint32_t u;
        std::memcpy(&u, &f, sizeof u);
        return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
    }
};
static_assert(sizeof(bf16) == 2, "bf16 is two bytes");

// The dtype codes the C entry points take (kernels/native.py passes them); kI8: int8 KV rows with
// their scales (cache/kv_format.py).
enum DType : int { kF32 = 0, kBF16 = 1, kI8 = 2 };

// The thread count of the current call: the caller's torch.get_num_threads(), passed into every entry
// point (OpenMP's own setting is per thread, and the engine runs on a thread of its own).
inline int& call_threads() {
    static thread_local int n = 1;
    return n;
}

// f(b, e) over [begin, end) in one chunk per thread, as at::parallel_for chunks it (the same split,
// so a kernel's results do not depend on which binding ran it): serial when the range is at most
// `grain`, when already inside a parallel region, or with one thread.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
    if (begin >= end) return;
    const int64_t n = end - begin;
    int64_t threads = call_threads();
    if (grain > 0) threads = std::min<int64_t>(threads, (n + grain - 1) / grain);
    if (threads <= 1 || omp_in_parallel()) {
        f(begin, end);
        return;
    }
#pragma omp parallel num_threads(static_cast<int>(threads))
    {
        const int64_t team = omp_get_num_threads(), chunk = (n + team - 1) / team;
        const int64_t b = begin + omp_get_thread_num() * chunk;
        if (b < end) f(b, std::min(end, b + chunk));
    }
}

// A failed check's message, thrown to the entry point, which returns it to Python as a RuntimeError.
struct Error : std::runtime_error {
    using std::runtime_error::runtime_error;
};
template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
    std::ostringstream message;
    (message << ... << parts);
    throw Error(message.str());
}
#define CONVEYOR_CHECK(cond, ...)                         \
    do {                                                  \
        if (!(cond)) ::conveyor::fail(__VA_ARGS__);       \
    } while (0)

// The calling thread's last error message (runtime.cpp; `conveyor_last_error` returns it).
std::string& last_error();

// An entry point's body run on `threads` threads: 0, or -1 with the message kept for
// `conveyor_last_error` (an exception must not cross the C ABI).
template <typename F>
int guarded(int threads, F&& body) {
    int& current = call_threads();
    const int saved = current;
    current = std::max(threads, 1);
    int status = 0;
    try {
        body();
    } catch (const std::exception& e) {
        last_error() = e.what();
        status = -1;
    }
    current = saved;
    return status;
}

}  // namespace conveyor
