// Fused elementwise ops of the Llama decoder layer on CPU (fp32 or bf16): RMSNorm (after the residual
// add, or alone), rotary embedding (in place) and SiLU(gate) * up, each one pass instead of the 3-10
// small PyTorch ops it replaces (at decode batch sizes those ops cost more in dispatch and thread
// fork/join than in arithmetic). Each op rounds like the PyTorch sequence it replaces (built with
// -ffp-contract=off: no fused multiply-adds); only RMSNorm's sum of squares is added in another order. bf16 inputs
// are computed in fp32 and rounded to bf16 wherever the PyTorch bf16 op would round (SiLU * up:
// once, at the end). AVX-512 (and for SiLU, AVX2) vectors where the CPU has them, the same
// operations in the same order as the scalar loops (SiLU's e^x is a vector polynomial to ~1 ulp
// instead of libm's): a 512-token prefill chunk spent ~9% of its time in scalar expf calls. The
// per-row arithmetic is row_ops.h's, which the native decode stack runs too: a row gets the same bits
// on either path.
#include "row_ops.h"

#include <type_traits>

using namespace conveyor;

namespace {

// Rows are processed on one thread up to this many (decode batches), split across threads above.
constexpr int64_t kRowGrain = 64;

// Calls f with a null pointer of the element type `dtype` names (float or bf16).
template <typename F>
void dispatch(int dtype, F&& f) {
    if (dtype == kF32) f(static_cast<float*>(nullptr));
    else f(static_cast<bf16*>(nullptr));
}

}  // namespace

// out = weight * (x * rsqrt(mean(x^2) + eps)) for `rows` contiguous rows of n (x, residual, weight and out
// of one dtype), as transformers' LlamaRMSNorm: the statistics in fp32, the normalized x rounded to x's
// dtype before the product with the weight. With a residual (else null), the residual stream's add first,
// in the same pass: x = x + residual in place, rounded to the dtype as PyTorch's add.
CONVEYOR_API int conveyor_rms_norm(int dtype, void* x, const void* residual, const void* weight, int64_t rows,
                                   int64_t n, float eps, void* out, int threads) {
    return guarded(threads, [&] {
        dispatch(dtype, [&](auto* tag) {
            using T = std::remove_pointer_t<decltype(tag)>;
            T* xp = static_cast<T*>(x);
            const T* rp = static_cast<const T*>(residual);
            const T* w = static_cast<const T*>(weight);
            T* op = static_cast<T*>(out);
            parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
                for (int64_t r = begin; r < end; ++r) {
                    if (rp) add_row(xp + r * n, rp + r * n, n);
                    rms_norm_row<T>(xp + r * n, w, n, eps, op + r * n);
                }
            });
        });
    });
}

// x * cos + rotate_half(x) * sin, in place: x is [tokens, heads, dim] with contiguous heads, token rows
// `row` elements apart (a view into the fused qkv output is fine), cos and sin contiguous [tokens,
// dim] of x's dtype. In bf16 each product and the sum round to bf16, as the PyTorch expression does.
CONVEYOR_API int conveyor_rope(int dtype, void* x, int64_t tokens, int64_t heads, int64_t dim, int64_t row,
                               const void* cos, const void* sin, int threads) {
    return guarded(threads, [&] {
        dispatch(dtype, [&](auto* tag) {
            using T = std::remove_pointer_t<decltype(tag)>;
            T* xp = static_cast<T*>(x);
            const T* cp = static_cast<const T*>(cos);
            const T* sp = static_cast<const T*>(sin);
            parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
                for (int64_t t = begin; t < end; ++t)
                    for (int64_t h = 0; h < heads; ++h) rope_head<T>(xp + t * row + h * dim, cp + t * dim, sp + t * dim, dim);
            });
        });
    });
}

// out [rows, n] = silu(gate) * up for contiguous rows gate_up = [gate | up] of 2n (bf16: in fp32,
// rounded once).
CONVEYOR_API int conveyor_silu_mul(int dtype, const void* gate_up, int64_t rows, int64_t n, void* out, int threads) {
    return guarded(threads, [&] {
        dispatch(dtype, [&](auto* tag) {
            using T = std::remove_pointer_t<decltype(tag)>;
            const T* gp = static_cast<const T*>(gate_up);
            T* op = static_cast<T*>(out);
            parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
                for (int64_t r = begin; r < end; ++r) {
                    const T* g = gp + r * 2 * n;
                    silu_mul_row<T>(g, g + n, n, op + r * n);
                }
            });
        });
    });
}
