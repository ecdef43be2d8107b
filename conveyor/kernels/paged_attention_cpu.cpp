// Attention straight from the paged KV cache on CPU, fp32 or bf16 (bf16 widened to fp32 on load;
// scores, softmax and sums in fp32; bf16 output rounded once): the PyTorch entry points.
//
// Decode: one query token per request, one task per request (`attend_request`, attention_cpu.h);
// K/V read from the pages in place, after the pass wrote the new K/V.
// Prefill: prefill_attention_cpu.cpp, before the pass writes the chunks' own K/V.
// `softcap` > 0 caps the scores as Gemma 2 does: tanh(score / softcap) * softcap; 0 leaves them.
// `sinks` (None: none): gpt-oss's attention sinks, one logit per query head (attention_blocks.h).
#include "attention_cpu.h"
#include "prefill_attention_cpu.h"

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <type_traits>
#include <vector>

using namespace conveyor;

namespace {

template <typename T>
void decode(const T* qp, const T* kp, const T* vp, const int64_t* bt, const int64_t* lens, const int64_t* positions,
            int64_t window, T* op, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t max_blocks, int64_t page_size,
            float scale, float cap, const float* sinks) {
    constexpr bool fp32 = std::is_same_v<T, float>;
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
        DecodeScratch scratch;
        std::vector<float> qf(fp32 ? 0 : H * D), of(fp32 ? 0 : H * D);
        for (int64_t b = begin; b < end; ++b) {
            const float* qb;
            float* ob;
            if constexpr (fp32) {
                qb = qp + b * H * D;
                ob = op + b * H * D;
            } else {
                for (int64_t i = 0; i < H * D; ++i) qf[i] = static_cast<float>(qp[b * H * D + i]);
                qb = qf.data();
                ob = of.data();
            }
            // A sliding window's ring holds positions [position - len + 1, position], p at slot p % window.
            const int64_t first = window > 0 ? positions[b] - lens[b] + 1 : 0;
            attend_request<T>(qb, kp, vp, bt + b * max_blocks, lens[b], first, window, page_size, Hkv, D, H / Hkv, 0,
                              Hkv, scale, cap, sinks, scratch, ob);
            if constexpr (!fp32)
                for (int64_t i = 0; i < H * D; ++i) op[b * H * D + i] = bf16(of[i]);
        }
    });
}

void check_dtype(const torch::Tensor& t, at::ScalarType dtype, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, name, " must be a CPU tensor of the cache's dtype");
}

// The attention sinks' logits as the kernels take them: fp32 [heads] (nullptr: none).
const float* sink_logits(const c10::optional<torch::Tensor>& sinks, int64_t heads) {
    if (!sinks.has_value()) return nullptr;
    TORCH_CHECK(sinks->device().is_cpu() && sinks->scalar_type() == torch::kFloat32 && sinks->is_contiguous() &&
                sinks->dim() == 1 && sinks->numel() == heads, "sinks must be a contiguous fp32 CPU tensor of one logit "
                "per query head (", heads, "), got ", sinks->sizes());
    return sinks->data_ptr<float>();
}

void check_heads(const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2), name,
                " must be [tokens, heads, dim] with contiguous heads");
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q,             // [B, H, D]
                                     torch::Tensor kv_cache,      // [2, slots, Hkv, D]
                                     torch::Tensor block_tables,  // [B, max_blocks] int64
                                     torch::Tensor context_lens,  // [B] int64
                                     c10::optional<torch::Tensor> positions,  // [B] int64: each row's position
                                     int64_t window,              // > 0: the tables are rings of `window` slots
                                     int64_t page_size, double scale, double softcap,
                                     c10::optional<torch::Tensor> sinks) {  // [H] fp32 attention-sink logits
    const auto dtype = kv_cache.scalar_type();
    TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "fp32 or bf16 only");
    check_dtype(q, dtype, "q");
    TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && block_tables.is_contiguous() &&
                context_lens.is_contiguous(), "contiguous inputs only");
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2), slots = kv_cache.size(1), Hkv = kv_cache.size(2);
    TORCH_CHECK(D <= kMaxDecodeHeadDim, "head dim ", D, " is above the CPU kernel's limit of ", kMaxDecodeHeadDim);
    TORCH_CHECK(H % Hkv == 0, "query heads ", H, " are not a multiple of kv heads ", Hkv);
    TORCH_CHECK(window <= 0 || (positions.has_value() && positions->is_contiguous() &&
                                positions->scalar_type() == torch::kInt64 && positions->numel() == B),
                "a sliding window needs every row's position (int64 [B])");
    auto out = torch::empty_like(q);
    const int64_t* bt = block_tables.data_ptr<int64_t>();
    const int64_t* lens = context_lens.data_ptr<int64_t>();
    const int64_t* pos = window > 0 ? positions->data_ptr<int64_t>() : nullptr;
    const float* sink = sink_logits(sinks, H);
    const auto run = [&](auto* qp, auto* kp, auto* op) {
        decode(qp, kp, kp + slots * Hkv * D, bt, lens, pos, std::max<int64_t>(window, 0), op, B, H, Hkv, D,
               block_tables.size(1), page_size, static_cast<float>(scale), static_cast<float>(softcap), sink);
    };
    if (dtype == torch::kFloat32)
        run(q.data_ptr<float>(), kv_cache.data_ptr<float>(), out.data_ptr<float>());
    else
        run(q.data_ptr<bf16>(), kv_cache.data_ptr<bf16>(), out.data_ptr<bf16>());
    return out;
}

// Writes the attention output of every prefill chunk's rows into `out`; call it before the pass
// writes the new K/V into the cache.
void paged_prefill_attention(torch::Tensor q,          // [T, H, D] the batch's queries
                             torch::Tensor k,          // [T, Hkv, D] the batch's new keys
                             torch::Tensor v,          // [T, Hkv, D] and values
                             torch::Tensor kv_cache,   // [2, slots, Hkv, D]
                             torch::Tensor ctx_slots,  // [sum of n_ctx] int64: each chunk's context slots, in order
                             torch::Tensor chunks,     // [C, 5] int64: q_start, q_len, offset into ctx_slots, n_ctx, start
                             int64_t window, double scale, double softcap,
                             torch::Tensor out,        // [T, H, D] contiguous
                             c10::optional<torch::Tensor> sinks) {  // [H] fp32 attention-sink logits
    const auto dtype = kv_cache.scalar_type();
    TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "fp32 or bf16 only");
    for (const auto* t : {&q, &k, &v, &out}) check_dtype(*t, dtype, "q, k, v and out");
    check_heads(q, "q");
    check_heads(k, "k");
    check_heads(v, "v");
    TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous, shaped like q");
    TORCH_CHECK(kv_cache.is_contiguous() && ctx_slots.is_contiguous() && chunks.is_contiguous() &&
                ctx_slots.scalar_type() == torch::kInt64 && chunks.scalar_type() == torch::kInt64 &&
                chunks.dim() == 2 && chunks.size(1) == 5, "ctx_slots [n] and chunks [C, 5]: contiguous int64");
    const int64_t H = q.size(1), D = q.size(2), Hkv = kv_cache.size(2), slots = kv_cache.size(1);
    TORCH_CHECK(k.size(1) == Hkv && k.size(2) == D && H % Hkv == 0, "head counts or sizes disagree");
    const float* sink = sink_logits(sinks, H);
    const int64_t* c = chunks.data_ptr<int64_t>();
    for (int64_t i = 0; i < chunks.size(0); ++i)
        TORCH_CHECK(c[i * 5 + 4] >= c[i * 5 + 3], "chunk ", i, " starts at position ", c[i * 5 + 4], " after ",
                    c[i * 5 + 3], " context positions: its context is the positions before it");
    const auto run = [&](auto* qp, auto* kp, auto* vp, auto* cp, auto* op) {
        using T = std::remove_const_t<std::remove_pointer_t<decltype(qp)>>;
        prefill_attention<T>({qp, kp, vp, cp, cp + slots * Hkv * D, q.stride(0), k.stride(0), v.stride(0),
                              ctx_slots.data_ptr<int64_t>(), chunks.data_ptr<int64_t>(), chunks.size(0), H, Hkv, D,
                              window, static_cast<float>(scale), static_cast<float>(softcap), sink, op});
    };
    if (dtype == torch::kFloat32)
        run(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), kv_cache.data_ptr<float>(),
            out.data_ptr<float>());
    else
        run(q.data_ptr<bf16>(), k.data_ptr<bf16>(), v.data_ptr<bf16>(), kv_cache.data_ptr<bf16>(),
            out.data_ptr<bf16>());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache (CPU)",
          py::arg("q"), py::arg("kv_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("positions"),
          py::arg("window"), py::arg("page_size"), py::arg("scale"), py::arg("softcap"), py::arg("sinks") = py::none(),
          py::call_guard<py::gil_scoped_release>());
    m.def("paged_prefill_attention", &paged_prefill_attention, "prefill attention over the paged KV cache (CPU)",
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("kv_cache"), py::arg("ctx_slots"), py::arg("chunks"),
          py::arg("window"), py::arg("scale"), py::arg("softcap"), py::arg("out"), py::arg("sinks") = py::none(),
          py::call_guard<py::gil_scoped_release>());
    m.def("prefill_vector_width", &conveyor::prefill_vector_width,
          "floats per vector register in the prefill kernel (16: AVX-512)");
}
