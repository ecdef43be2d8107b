// Decode attention straight from the paged KV cache on CPU (fp32).
//
// One query token per request. Every query head is scored against the request's cached keys
// page by page, softmaxed and used to weight the values, reading every cached K/V row exactly
// once, without first gathering them into a contiguous copy (which costs a full extra read and
// write of the context per layer). `softcap` > 0 caps the scores as Gemma 2 does:
// tanh(score / softcap) * softcap; 0 leaves them alone.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q,             // [B, H, D]
                                     torch::Tensor kv_cache,      // [2, slots, Hkv, D]
                                     torch::Tensor block_tables,  // [B, max_blocks] int64
                                     torch::Tensor context_lens,  // [B] int64
                                     int64_t page_size, double scale, double softcap) {
    TORCH_CHECK(q.scalar_type() == torch::kFloat32 && kv_cache.scalar_type() == torch::kFloat32, "fp32 only");
    TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && block_tables.is_contiguous() &&
                context_lens.is_contiguous(), "contiguous inputs only");
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
    const int64_t slots = kv_cache.size(1), Hkv = kv_cache.size(2);
    const int64_t G = H / Hkv, max_blocks = block_tables.size(1);  // G query heads share a kv head
    auto out = torch::empty_like(q);
    const float* qp = q.data_ptr<float>();
    const float* kp = kv_cache.data_ptr<float>();
    const float* vp = kp + slots * Hkv * D;
    const int64_t* bt = block_tables.data_ptr<int64_t>();
    const int64_t* lens = context_lens.data_ptr<int64_t>();
    float* op = out.data_ptr<float>();
    const float fscale = static_cast<float>(scale);
    const float fcap = static_cast<float>(softcap);

    // One task per request: its cached rows (all kv heads of a token, contiguous) are swept in
    // order, which the hardware prefetcher streams far better than one head's strided slices.
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores;
        std::vector<float> acc(H * D);
        for (int64_t b = begin; b < end; ++b) {
            const int64_t len = lens[b];
            scores.assign(H * len, 0.f);
            const float* qb = qp + b * H * D;
            for (int64_t t = 0; t < len; ++t) {
                const int64_t slot = bt[b * max_blocks + t / page_size] * page_size + t % page_size;
                const float* row = kp + slot * Hkv * D;
                for (int64_t h = 0; h < H; ++h) {
                    const float* qh = qb + h * D;
                    const float* k = row + (h / G) * D;
                    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; ++d) dot += qh[d] * k[d];
                    const float score = dot * fscale;
                    scores[h * len + t] = fcap > 0.f ? std::tanh(score / fcap) * fcap : score;
                }
            }
            for (int64_t h = 0; h < H; ++h) {
                float* s = scores.data() + h * len;
                const float mx = *std::max_element(s, s + len);
                float sum = 0.f;
                for (int64_t t = 0; t < len; ++t) sum += (s[t] = std::exp(s[t] - mx));
                const float inv = 1.f / sum;
                for (int64_t t = 0; t < len; ++t) s[t] *= inv;
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            for (int64_t t = 0; t < len; ++t) {
                const int64_t slot = bt[b * max_blocks + t / page_size] * page_size + t % page_size;
                const float* row = vp + slot * Hkv * D;
                for (int64_t h = 0; h < H; ++h) {
                    const float p = scores[h * len + t];
                    const float* v = row + (h / G) * D;
                    float* a = acc.data() + h * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
                }
            }
            std::copy(acc.begin(), acc.end(), op + b * H * D);
        }
    });
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache (fp32, CPU)");
}
