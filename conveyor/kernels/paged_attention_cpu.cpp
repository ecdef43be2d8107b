// Decode attention straight from the paged KV cache on CPU (fp32).
//
// One query token per request. Each (request, kv head) pair is one task: the query heads of that
// kv group are scored against the request's cached keys page by page, softmaxed and used to
// weight the values, reading every cached K/V row exactly once, without first gathering them
// into a contiguous copy (which costs a full extra read and write of the context per layer).
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
                                     int64_t page_size, double scale) {
    TORCH_CHECK(q.scalar_type() == torch::kFloat32 && kv_cache.scalar_type() == torch::kFloat32, "fp32 only");
    TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && block_tables.is_contiguous() &&
                context_lens.is_contiguous(), "contiguous inputs only");
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
    const int64_t slots = kv_cache.size(1), Hkv = kv_cache.size(2);
    const int64_t G = H / Hkv, max_blocks = block_tables.size(1);
    auto out = torch::empty_like(q);
    const float* qp = q.data_ptr<float>();
    const float* kp = kv_cache.data_ptr<float>();
    const float* vp = kp + slots * Hkv * D;
    const int64_t* bt = block_tables.data_ptr<int64_t>();
    const int64_t* lens = context_lens.data_ptr<int64_t>();
    float* op = out.data_ptr<float>();
    const float fscale = static_cast<float>(scale);

    at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores;
        std::vector<float> acc(G * D);
        for (int64_t task = begin; task < end; ++task) {
            const int64_t b = task / Hkv, g = task % Hkv, len = lens[b];
            scores.assign(G * len, 0.f);
            const float* qg = qp + (b * H + g * G) * D;
            for (int64_t t = 0; t < len; ++t) {
                const int64_t slot = bt[b * max_blocks + t / page_size] * page_size + t % page_size;
                const float* k = kp + (slot * Hkv + g) * D;
                for (int64_t i = 0; i < G; ++i) {
                    const float* qi = qg + i * D;
                    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < D; ++d) dot += qi[d] * k[d];
                    scores[i * len + t] = dot * fscale;
                }
            }
            for (int64_t i = 0; i < G; ++i) {
                float* s = scores.data() + i * len;
                const float mx = *std::max_element(s, s + len);
                float sum = 0.f;
                for (int64_t t = 0; t < len; ++t) sum += (s[t] = std::exp(s[t] - mx));
                const float inv = 1.f / sum;
                for (int64_t t = 0; t < len; ++t) s[t] *= inv;
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            for (int64_t t = 0; t < len; ++t) {
                const int64_t slot = bt[b * max_blocks + t / page_size] * page_size + t % page_size;
                const float* v = vp + (slot * Hkv + g) * D;
                for (int64_t i = 0; i < G; ++i) {
                    const float p = scores[i * len + t];
                    float* a = acc.data() + i * D;
                    for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
                }
            }
            std::copy(acc.begin(), acc.end(), op + (b * H + g * G) * D);
        }
    });
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache (fp32, CPU)");
}
