// The whole decoder-layer stack of a Llama-family model with tiled weights (quantized or bf16), for a
// decode batch of up to 64 rows, in one call and one OpenMP parallel region.
//
// At one row a step streams the model's weights once; run op by op from Python it also pays dispatch
// and thread fork/join for every op of every layer, at small models as much again. Here the threads
// stay up for the whole stack and meet at barriers (8 a layer; 10 when there are fewer rows than
// threads): the matmuls split their output tiles across threads (each streams its own slice of every
// weight), and the elementwise steps (norms, RoPE, K/V writes, SiLU, residual adds, activation
// quantization) and attention split the rows, or, with fewer rows than threads, attention splits the
// (row, kv head) pairs. A layer whose MLP is a mixture of experts runs the eager layer's `MoeBlock`
// (moe_block.h) in its place, with the block's own phases and barriers.
//
// It computes exactly what the eager layers compute, bit for bit: the same GEMM and attention kernels,
// the fused ops' per-row arithmetic (row_ops.h), and in a bf16 model every value rounded to bf16 where
// the eager path's bf16 tensors round it (projection outputs, attention output, residual adds); values
// are held in fp32 arrays, bf16-exact. So a request's tokens do not depend on whether its step went
// through the stack (decode-only, <= 64 rows) or the eager layers (batch invariance).
//
// With LoRA adapters (`set_lora`: a projection's stacked adapter weights, the `LoRALinear`'s tensors, by
// address), a step's rows that have an adapter get its delta after each base projection (lora_delta.h,
// the per-layer kernel's phases, so the same bits): the shrink runs right after the base matmul (it reads
// only the projection's input), then past the matmul's barrier each thread finishes its own rows (bias,
// rounding) and adds their deltas before its elementwise work on them, so adapters add no barrier
// (one, before thread 0's K/V writes, when there are fewer rows than threads).
#include "attention_cpu.h"
#include "lora_delta.h"
#include "mamba_row.h"
#include "moe_block.h"
#include "quant.h"
#include "row_ops.h"
#include "short_conv.h"
#include "tiled_linear.h"
#include "vec_math.h"

#include <omp.h>

#include <cmath>
#include <cstring>
#include <memory>

namespace {

using conveyor::Activations;
using conveyor::Linear;
using conveyor::round_row;
using conveyor::Segment;
using conveyor::silu_mul;

// One projection's adapters: the stacked weights (fp32 or bf16, `dtype`) of lora_delta.h's layout; a null
// `a` where the projection has none.
struct LoRAProjection {
    const void* a = nullptr;
    const void* b = nullptr;
    const int64_t *slice_rows = nullptr, *slice_block = nullptr;
    int64_t n_slices = 0, rank = 0, blocks = 0, in = 0, out = 0;
    int dtype = 0;

    template <typename W>
    conveyor::LoRAWeights<W> weights() const {
        return {static_cast<const W*>(a), static_cast<const W*>(b), slice_rows, slice_block, n_slices, rank, blocks,
                in, out};
    }
};

// A decoder layer. An attention layer's qkv and o projections; or, in a short-convolution layer (LFM2's:
// `taps` set), in_proj (B, C and x, 3 x hidden) and out_proj in their places, its state a ring of its last
// `kernel` inputs in its KV pages (layers/short_conv.py's layout); or, in a Mamba-2 layer (Granite 4.0-H's:
// `mamba` set), the mixer's in_proj and out_proj there, its ring and SSM state in its KV pages (mamba_row.h).
struct Layer {
    std::vector<float> input_norm, post_norm;
    std::vector<float> q_norm, k_norm;  // per-head q/k norms before RoPE (Qwen3's, LFM2's), [D]; empty: none
    std::vector<float> sinks;  // one attention-sink logit per query head (gpt-oss's), [H]; empty: none
    std::vector<float> taps, conv_bias;  // a conv layer's kernel [kernel][hidden] and bias [hidden] (or empty)
    Linear qkv, o, gate_up, down;
    LoRAProjection lora[4];  // qkv, o, gate_up, down
    std::unique_ptr<conveyor::MambaWeights> mamba;  // a Mamba-2 layer's mixer
    conveyor::MoeBlock* moe = nullptr;  // the MLP, a mixture-of-experts block (the eager layer's object)
    int64_t group = 0;  // which layer group's attention metadata this layer reads
    bool rope = true;  // false: a NoPE layer (SmolLM3's every fourth), q and k as projected
};

// The residual add of a layer's output: x = x + y, rounded as a bf16 add rounds.
template <typename T>
void add_row(float* x, const float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] = conveyor::round_as<T>(x[i] + y[i]);
}

template <typename T>
void store_row(T* dst, const float* src, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) conveyor::store16(dst + i, _mm512_loadu_ps(src + i));
#endif
    for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// A slot's new K (or V) heads, kv_heads x D fp32 values (bf16-exact in a bf16 model), into the cache:
// as they are, or quantized to int8 head rows.
template <typename C>
void store_kv_heads(C* dst, const float* src, int64_t kv_heads, int64_t D) {
    if constexpr (conveyor::kScaled<C>)
        for (int64_t h = 0; h < kv_heads; ++h) conveyor::quantize_head_row(src + h * D, D, dst + h * conveyor::head_row<C>(D));
    else
        store_row(dst, src, kv_heads * D);
}

}  // namespace

class DecodeStack {
  public:
    DecodeStack(int64_t hidden, int64_t intermediate, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
                double scale, int64_t max_rows)
        : hidden_(hidden), inter_(intermediate), H_(heads), Hkv_(kv_heads), D_(head_dim), eps_(eps), scale_(scale),
          max_rows_(max_rows) {
        CONVEYOR_CHECK(head_dim <= conveyor::kMaxDecodeHeadDim, "head dim ", head_dim, " is above the CPU kernel's limit of ",
                       conveyor::kMaxDecodeHeadDim);
        CONVEYOR_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads ", heads, " are not a multiple of kv heads ",
                       kv_heads);
        const int64_t qkv = (H_ + 2 * Hkv_) * D_;
        xn_.resize(max_rows * std::max(hidden, H_ * D_));
        qkv_.resize(max_rows * std::max(qkv, 3 * hidden));  // (or a conv layer's B, C and x)
        attn_.resize(max_rows * std::max(H_ * D_, hidden));
        mid_.resize(max_rows * 2 * intermediate);
        act_.resize(max_rows * intermediate);
        out_.resize(max_rows * hidden);
    }

    // The next layer: its norms' weights (fp32, copied), per linear (qkv, o, gate_up, down) its row
    // segments (tiles of a quantized type or BF16, in output order) and bias (fp32 [N], copied, or
    // nullptr), which layer group's attention metadata it reads, and whether it rotates q and k; its
    // per-head q/k norm weights ([D] each, or nullptr). A conv layer: `taps` [kernel][hidden] (else
    // nullptr) and its bias [hidden] (or nullptr), in_proj and out_proj in the places of qkv and o.
    void add_layer(const float* input_norm, const float* post_norm, const conveyor::SegmentSpec* const* segments,
                   const int64_t* counts, const float* const* biases, int64_t group, bool rope, const float* q_norm,
                   const float* k_norm, const float* taps, int64_t kernel, const float* conv_bias) {
        Layer layer;
        layer.input_norm.assign(input_norm, input_norm + hidden_);
        layer.post_norm.assign(post_norm, post_norm + hidden_);
        layer.group = group;
        layer.rope = rope;
        CONVEYOR_CHECK(!q_norm == !k_norm, "q and k norms come together");
        if (q_norm) layer.q_norm.assign(q_norm, q_norm + D_), layer.k_norm.assign(k_norm, k_norm + D_);
        const bool conv = taps != nullptr;
        if (conv) {
            CONVEYOR_CHECK(kernel >= 1, "a conv layer's kernel must be at least 1, got ", kernel);
            layer.taps.assign(taps, taps + kernel * hidden_);
            if (conv_bias) layer.conv_bias.assign(conv_bias, conv_bias + hidden_);
        }
        const int64_t K[4] = {hidden_, conv ? hidden_ : H_ * D_, hidden_, inter_};
        const int64_t N[4] = {conv ? 3 * hidden_ : (H_ + 2 * Hkv_) * D_, hidden_, 2 * inter_, hidden_};
        set_linears(layer, segments, counts, biases, K, N);
        layers_.push_back(std::move(layer));
    }

    // The next layer, a Mamba-2 layer: its norms, its four linears (the mixer's in_proj and out_proj, gate_up,
    // down) as `add_layer` takes them, its layer group, and the mixer's shape and weights (copied).
    void add_mamba_layer(const float* input_norm, const float* post_norm, const conveyor::SegmentSpec* const* segments,
                         const int64_t* counts, const float* const* biases, int64_t group,
                         const conveyor::MambaSpec& spec) {
        Layer layer;
        layer.input_norm.assign(input_norm, input_norm + hidden_);
        layer.post_norm.assign(post_norm, post_norm + hidden_);
        layer.group = group;
        layer.mamba = std::make_unique<conveyor::MambaWeights>();
        layer.mamba->assign(spec);
        const int64_t K[4] = {hidden_, spec.inner(), hidden_, inter_};
        const int64_t N[4] = {spec.in_width(), hidden_, 2 * inter_, hidden_};
        set_linears(layer, segments, counts, biases, K, N);
        qkv_.resize(std::max<size_t>(qkv_.size(), max_rows_ * spec.in_width()));
        attn_.resize(std::max<size_t>(attn_.size(), max_rows_ * spec.inner()));
        mamba_conv_.resize(std::max<size_t>(mamba_conv_.size(), max_rows_ * spec.scratch()));
        mamba_y_.resize(std::max<size_t>(mamba_y_.size(), max_rows_ * spec.inner()));
        mamba_inner_ = std::max(mamba_inner_, spec.inner());
        layers_.push_back(std::move(layer));
    }

    // Layer `l`'s attention has sinks: one logit per query head (fp32 [H], copied), as the eager kernel takes them.
    void set_sinks(int64_t l, const float* sinks) {
        CONVEYOR_CHECK(l >= 0 && l < static_cast<int64_t>(layers_.size()), "no layer ", l);
        layers_[l].sinks.assign(sinks, sinks + H_);
    }

    // Layer `l`'s MLP is `block` (the layer was added without gate_up and down), run by the stack's threads.
    void set_moe(int64_t l, conveyor::MoeBlock* block) {
        CONVEYOR_CHECK(l >= 0 && l < static_cast<int64_t>(layers_.size()), "no layer ", l);
        CONVEYOR_CHECK(layers_[l].gate_up.N == 0, "layer ", l, " has a dense MLP");
        CONVEYOR_CHECK(block && block->hidden() == hidden_, "the block's hidden size is not the stack's");
        layers_[l].moe = block;
    }

    // Each layer's output times `scale` (rounded to the model's dtype) before its residual add: Granite's
    // residual multiplier (1: none).
    void set_residual_scale(float scale) { residual_scale_ = scale; }

    // Layer `l`'s projection `p` (0..3: qkv, o, gate_up, down) adds adapter deltas: A `[slots, in, blocks *
    // rank]`, B `[slots, rank, out]`, `slice_rows` [n_slices + 1], `slice_block` [slots, n_slices], all
    // kept by the caller (their values may change between calls, their addresses not).
    void set_lora(int64_t l, int64_t p, int dtype, const void* a, const void* b, const int64_t* slice_rows,
                  const int64_t* slice_block, int64_t n_slices, int64_t rank, int64_t blocks) {
        CONVEYOR_CHECK(l >= 0 && l < static_cast<int64_t>(layers_.size()) && p >= 0 && p < 4, "no projection ", p,
                       " in layer ", l);
        Layer& L = layers_[l];
        const Linear* lin[4] = {&L.qkv, &L.o, &L.gate_up, &L.down};
        CONVEYOR_CHECK(slice_rows[n_slices] == lin[p]->N, "the adapter's slices cover ", slice_rows[n_slices],
                       " output rows, the projection has ", lin[p]->N);
        CONVEYOR_CHECK(dtype == conveyor::kF32 || dtype == conveyor::kBF16, "adapter weights must be fp32 or bf16");
        L.lora[p] = LoRAProjection{a, b, slice_rows, slice_block, n_slices, rank, blocks, lin[p]->K, lin[p]->N, dtype};
        lora_width_ = std::max(lora_width_, rank * blocks);
    }

    // x [B, hidden] fp32, updated in place; cos/sin [B, D] fp32; per layer its KV cache [2, slots, Hkv,
    // D] (the model's dtype `dtype`, or int8 rows with their scales: `kv_dtype` kI8) and its slot count; per layer group its decode block tables [B,
    // width], context lengths [B], the slots [B] the new K/V go to and its sliding window (0: none; its
    // tables are then rings of that many slots); the rows' positions [B]. `shared_rows`: some request
    // has several rows (speculative proposals): every row's K/V is stored before any row attends.
    void forward(float* x, int64_t B, const float* cos, const float* sin, int dtype, int kv_dtype, void* const* kv,
                 const int64_t* kv_slots, int64_t num_kv, const int64_t* const* tables, const int64_t* widths,
                 const int64_t* const* lens, const int64_t* const* slots, const int64_t* windows, int64_t groups,
                 const int64_t* positions, int64_t page_size, int threads, bool shared_rows,
                 const conveyor::LoRAGroups& lora) {
        CONVEYOR_CHECK(B >= 1 && B <= max_rows_, "the stack takes 1 to ", max_rows_, " rows, got ", B);
        if (lora.n_groups) {
            for (const Layer& L : layers_)
                for (const LoRAProjection& p : L.lora)
                    CONVEYOR_CHECK(!p.a || p.dtype == dtype, "adapter weights must have the model's dtype");
            for (int64_t p = 0; p < lora.rows(); ++p)
                CONVEYOR_CHECK(lora.order[p] >= 0 && lora.order[p] < B, "adapter row ", lora.order[p], " is not one of the ",
                               B, " rows");
            lora_t_.resize(lora.rows() * lora_width_);
        }
        CONVEYOR_CHECK(num_kv == static_cast<int64_t>(layers_.size()), "one KV cache per layer expected");
        for (const Layer& L : layers_) {
            CONVEYOR_CHECK(L.group >= 0 && L.group < groups, "layer group ", L.group, " has no attention metadata");
            CONVEYOR_CHECK(L.moe || L.gate_up.N > 0, "a layer has no MLP");
            if (L.moe) L.moe->begin(B);
        }
        const Step step{x, cos, sin, kv, kv_slots, tables, widths, lens, slots, windows, positions, page_size, lora};
        using conveyor::bf16;
        if (kv_dtype == conveyor::kI8) {
            if (dtype == conveyor::kF32) run<float, int8_t>(step, B, threads, shared_rows);
            else run<bf16, int8_t>(step, B, threads, shared_rows);
        } else {
            CONVEYOR_CHECK(kv_dtype == dtype, "the KV cache must be int8 or of the model's dtype");
            if (dtype == conveyor::kF32) run<float, float>(step, B, threads, shared_rows);
            else run<bf16, bf16>(step, B, threads, shared_rows);
        }
    }

  private:
    // A layer's four linears (qkv, o, gate_up, down, or the mixer's in and out in the first two places): their
    // segments and biases, each checked against its input width K and output rows N. No gate_up and down
    // segments: the MLP is a mixture-of-experts block (`set_moe`).
    static void set_linears(Layer& layer, const conveyor::SegmentSpec* const* segments, const int64_t* counts,
                            const float* const* biases, const int64_t* K, const int64_t* N) {
        Linear* dst[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
        for (int i = 0; i < 4; ++i) {
            if (i >= 2 && counts[2] == 0 && counts[3] == 0) break;
            Linear& lin = *dst[i];
            lin.K = K[i];
            lin.add_segments(segments[i], counts[i]);
            CONVEYOR_CHECK(lin.N == N[i], "linear ", i, " has ", lin.N, " output rows, expected ", N[i]);
            lin.set_bias(biases[i]);
        }
    }

    // Rows [r0, r1) of this thread's elementwise work: norms, RoPE, K/V writes, SiLU, residual adds
    // and activation quantization touch only their own rows, so they need no barrier among them.
    // With at least one row per thread, each thread also runs its rows' attention right after
    // writing their K/V (after all rows' K/V when rows share a request); with fewer rows (one
    // stream), attention splits the (row, kv head) pairs.
    // One call's inputs (`forward`).
    struct Step {
        float* x;
        const float *cos, *sin;
        void* const* kv;
        const int64_t* kv_slots;
        const int64_t* const* tables;
        const int64_t* widths;
        const int64_t* const* lens;
        const int64_t* const* slots;
        const int64_t* windows;
        const int64_t* positions;
        int64_t page;
        conveyor::LoRAGroups lora;  // the rows with an adapter (n_groups 0: none)
    };

    // T: the model's dtype; C: the cache's rows (T, or int8).
    template <typename T, typename C>
    void run(const Step& in, int64_t B, int threads, bool shared_rows) {
        const int64_t qd = H_ * D_, kvd = Hkv_ * D_, qkv_n = qd + 2 * kvd, G = H_ / Hkv_, page = in.page;
        const int64_t kv_row = Hkv_ * conveyor::head_row<C>(D_);  // a slot's K (or V) row in the cache
        for (const Layer& L : layers_)  // (a Mamba layer's state rows must each lie within one half of a slot)
            CONVEYOR_CHECK(!L.mamba || (kv_row * static_cast<int64_t>(sizeof(C))) % (4 * L.mamba->spec.N) == 0,
                           "a Mamba state row of ", L.mamba ? L.mamba->spec.N : 0, " values does not fit this pool");
        float* xp = in.x;
        const float* cp = in.cos;
        const float* sp = in.sin;
        const float eps = static_cast<float>(eps_), scale = static_cast<float>(scale_);
        for (auto [act, K] : {std::pair{&act_hidden_, hidden_}, {&act_attn_, qd}, {&act_inter_, inter_},
                              {&act_mamba_, std::max<int64_t>(mamba_inner_, 1)}})
            act->shape(B, K), act->shape_floats(B, K, std::is_same_v<T, conveyor::bf16>);  // rows rounded to T
        const int nt_wanted = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, 64)));
#pragma omp parallel num_threads(nt_wanted)
        {
            const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t r0 = B * tid / nt, r1 = B * (tid + 1) / nt;
            const bool by_rows = B >= nt;
            conveyor::DecodeScratch scratch;
            const auto prepare = [&](const Linear& lin, const float* in, int64_t K, Activations& act) {  // rows r0..r1
                if (lin.quantized) conveyor::quantize_rows(in, K, r0, r1, act);
                if (lin.floats) conveyor::pack_float_rows(in, K, r0, r1, act);
            };
            const auto matmul = [&](const Linear& lin, const Activations& act, float* out, int64_t ld) {
                lin.run(act, out, ld, tid, nt);
            };
            std::vector<conveyor::LoRAShrinkItem> items;
            // this thread's share of a projection's adapter shrink (of its input x), after the base matmul
            const auto shrink = [&](const LoRAProjection& p, const float* x, int64_t ld) {
                const conveyor::LoRAWeights<T> w = p.weights<T>();
                conveyor::lora_shrink_items(in.lora, w.width(), items);
                const int64_t n = static_cast<int64_t>(items.size());
                conveyor::lora_shrink(x, ld, w, in.lora, items.data(), n * tid / nt, n * (tid + 1) / nt, lora_t_.data());
            };
            // past the barrier, this thread's rows: the base output's bias and rounding, then the deltas
            const auto add_deltas = [&](const Linear& lin, const LoRAProjection& p, float* y, int64_t ld) {
                const conveyor::LoRAWeights<T> w = p.weights<T>();
                for (int64_t b = r0; b < r1; ++b) {
                    lin.add_bias_row(y + b * ld);
                    round_row<T>(y + b * ld, w.out);
                }
                conveyor::lora_expand<T>(lora_t_.data(), w, in.lora, 0, w.vectors(), r0, r1, y, ld);
            };
            for (int64_t b = r0; b < r1; ++b)
                conveyor::rms_norm_row<T>(xp + b * hidden_, layers_[0].input_norm.data(), hidden_, eps,
                                          xn_.data() + b * hidden_);
            prepare(layers_[0].qkv, xn_.data(), hidden_, act_hidden_);
            for (size_t l = 0; l < layers_.size(); ++l) {
                const Layer& L = layers_[l];
                C* kc = static_cast<C*>(in.kv[l]);
                C* vc = kc + in.kv_slots[l] * kv_row;
                const int64_t* slot = in.slots[L.group];
                const int64_t* bt = in.tables[L.group];
                const int64_t width = in.widths[L.group];
                const int64_t* len = in.lens[L.group];
                const int64_t window = in.windows[L.group];
                const int64_t* pos = in.positions;
                // which projections add adapter deltas this step (their bias and rounding then come with them)
                bool adapted[4];
                for (int p = 0; p < 4; ++p) adapted[p] = in.lora.n_groups > 0 && L.lora[p].a != nullptr;
                const auto first = [&](int64_t b) { return window > 0 ? pos[b] - len[b] + 1 : 0; };  // a ring's first
                // kv heads [g0, g1) of row b, then (its first rows prefetched meanwhile) row nb's from 0, if nb < B
                const auto attend = [&](int64_t b, int64_t g0, int64_t g1, int64_t nb) {
                    scratch.next = nb < B ? conveyor::DecodeRun{bt + nb * width, len[nb], first(nb), window, 0}
                                          : conveyor::DecodeRun{};
                    conveyor::attend_request<C>(qkv_.data() + b * qkv_n + g0 * G * D_, kc, vc, bt + b * width, len[b],
                                                first(b), window, page, Hkv_, D_, G, g0, g1, scale, 0.f,
                                                L.sinks.empty() ? nullptr : L.sinks.data(), scratch,
                                                attn_.data() + b * qd + g0 * G * D_);
                    round_row<T>(attn_.data() + b * qd + g0 * G * D_, (g1 - g0) * G * D_);
                };
                const auto rope_and_store = [&](int64_t b) {
                    float* row = qkv_.data() + b * qkv_n;
                    if (!adapted[0]) {
                        L.qkv.add_bias_row(row);
                        round_row<T>(row, qkv_n);
                    }
                    for (int64_t h = 0; !L.q_norm.empty() && h < H_ + Hkv_; ++h)  // q heads, then k heads
                        conveyor::rms_norm_row<T>(row + h * D_, (h < H_ ? L.q_norm : L.k_norm).data(), D_, eps,
                                                  row + h * D_);
                    for (int64_t h = 0; L.rope && h < H_ + Hkv_; ++h)
                        conveyor::rope_head<T>(row + h * D_, cp + b * D_, sp + b * D_, D_);
                    store_kv_heads(kc + slot[b] * kv_row, row + qd, Hkv_, D_);
                    store_kv_heads(vc + slot[b] * kv_row, row + qd + kvd, Hkv_, D_);
                };
                if (L.mamba) {  // a Mamba-2 layer: its rows' convolutions, their heads' states, the gated norm
                    const conveyor::MambaSpec& m = L.mamba->spec;
                    const int64_t W = m.in_width(), S = m.scratch(), I = m.inner();
#pragma omp barrier
                    matmul(L.qkv, act_hidden_, qkv_.data(), W);
#pragma omp barrier
                    for (int64_t b = r0; b < r1; ++b) {
                        float* row = qkv_.data() + b * W;
                        L.qkv.add_bias_row(row);
                        round_row<T>(row, W);
                        mamba_row<T, C>(m, row, kc, vc, kv_row, bt + b * width, pos[b], page,
                                        mamba_conv_.data() + b * S);
                    }
#pragma omp barrier
                    const int64_t pairs = B * m.heads, p0 = pairs * tid / nt, p1 = pairs * (tid + 1) / nt;
                    for (int64_t ph = p0; ph < p1; ++ph) {
                        const int64_t b = ph / m.heads, h = ph % m.heads;
                        mamba_head<C>(m, h, kc, vc, kv_row, bt + b * width, page, pos[b] > 0,
                                      mamba_conv_.data() + b * S, mamba_y_.data() + b * I + h * m.P);
                    }
#pragma omp barrier
                    for (int64_t b = r0; b < r1; ++b)
                        conveyor::mamba_norm_row<T>(m, qkv_.data() + b * W, mamba_y_.data() + b * I,
                                                    attn_.data() + b * I);
                    prepare(L.o, attn_.data(), I, act_mamba_);
#pragma omp barrier
                    matmul(L.o, act_mamba_, out_.data(), hidden_);
#pragma omp barrier
                } else if (!L.taps.empty()) {  // a conv layer: its rows' convolutions, then out_proj
#pragma omp barrier
                    matmul(L.qkv, act_hidden_, qkv_.data(), 3 * hidden_);
#pragma omp barrier
                    for (int64_t b = r0; b < r1; ++b)
                        conv_row<T, C>(L, b, kc, vc, kv_row, bt + b * width, pos[b], page);
                    prepare(L.o, attn_.data(), hidden_, act_hidden_);
#pragma omp barrier
                    matmul(L.o, act_hidden_, out_.data(), hidden_);
#pragma omp barrier
                } else {
#pragma omp barrier
                matmul(L.qkv, act_hidden_, qkv_.data(), qkv_n);
                if (adapted[0]) shrink(L.lora[0], xn_.data(), hidden_);
#pragma omp barrier
                if (adapted[0]) {
                    add_deltas(L.qkv, L.lora[0], qkv_.data(), qkv_n);
                    if (!by_rows) {  // thread 0 then stores every row
#pragma omp barrier
                    }
                }
                if (by_rows && shared_rows) {  // a row may read what another thread's row stores
                    for (int64_t b = r0; b < r1; ++b) rope_and_store(b);
#pragma omp barrier
                    for (int64_t b = r0; b < r1; ++b) attend(b, 0, Hkv_, b + 1 < r1 ? b + 1 : B);
                } else if (by_rows) {
                    for (int64_t b = r0; b < r1; ++b) {
                        rope_and_store(b);
                        attend(b, 0, Hkv_, b + 1 < r1 ? b + 1 : B);
                    }
                } else {
                    if (tid == 0)
                        for (int64_t b = 0; b < B; ++b) rope_and_store(b);
#pragma omp barrier
                    const int64_t pairs = B * Hkv_, p0 = pairs * tid / nt, p1 = pairs * (tid + 1) / nt;
                    for (int64_t p = p0; p < p1;) {  // runs of kv heads of one row
                        const int64_t b = p / Hkv_, g1 = std::min(p1, (b + 1) * Hkv_);
                        attend(b, p % Hkv_, g1 - b * Hkv_, g1 < p1 ? b + 1 : B);
                        p = g1;
                    }
#pragma omp barrier
                }
                prepare(L.o, attn_.data(), qd, act_attn_);
#pragma omp barrier
                matmul(L.o, act_attn_, out_.data(), hidden_);
                if (adapted[1]) shrink(L.lora[1], attn_.data(), qd);
#pragma omp barrier
                if (adapted[1]) add_deltas(L.o, L.lora[1], out_.data(), hidden_);
                }
                for (int64_t b = r0; b < r1; ++b) {
                    if (!adapted[1]) {
                        L.o.add_bias_row(out_.data() + b * hidden_);
                        round_row<T>(out_.data() + b * hidden_, hidden_);
                    }
                    scale_row<T>(out_.data() + b * hidden_, hidden_);
                    add_row<T>(xp + b * hidden_, out_.data() + b * hidden_, hidden_);
                    conveyor::rms_norm_row<T>(xp + b * hidden_, L.post_norm.data(), hidden_, eps,
                                              xn_.data() + b * hidden_);
                }
                if (L.moe) {  // a mixture-of-experts block, its output rounded to T (it has its barriers)
                    L.moe->run<T>(xn_.data(), hidden_, out_.data(), hidden_, tid, nt);
                } else {
                    prepare(L.gate_up, xn_.data(), hidden_, act_hidden_);
#pragma omp barrier
                    matmul(L.gate_up, act_hidden_, mid_.data(), 2 * inter_);
                    if (adapted[2]) shrink(L.lora[2], xn_.data(), hidden_);
#pragma omp barrier
                    if (adapted[2]) add_deltas(L.gate_up, L.lora[2], mid_.data(), 2 * inter_);
                    for (int64_t b = r0; b < r1; ++b) {
                        float* gate = mid_.data() + b * 2 * inter_;
                        if (!adapted[2]) {
                            L.gate_up.add_bias_row(gate);
                            round_row<T>(gate, 2 * inter_);
                        }
                        conveyor::silu_mul_row<T>(gate, gate + inter_, inter_, act_.data() + b * inter_);
                    }
                    prepare(L.down, act_.data(), inter_, act_inter_);
#pragma omp barrier
                    matmul(L.down, act_inter_, out_.data(), hidden_);
                    if (adapted[3]) shrink(L.lora[3], act_.data(), inter_);
#pragma omp barrier
                    if (adapted[3]) add_deltas(L.down, L.lora[3], out_.data(), hidden_);
                }
                const Layer* next = l + 1 < layers_.size() ? &layers_[l + 1] : nullptr;
                for (int64_t b = r0; b < r1; ++b) {  // the residual add, then the next layer's input norm
                    if (!L.moe && !adapted[3]) {
                        L.down.add_bias_row(out_.data() + b * hidden_);
                        round_row<T>(out_.data() + b * hidden_, hidden_);
                    }
                    scale_row<T>(out_.data() + b * hidden_, hidden_);
                    add_row<T>(xp + b * hidden_, out_.data() + b * hidden_, hidden_);
                    if (next)
                        conveyor::rms_norm_row<T>(xp + b * hidden_, next->input_norm.data(), hidden_, eps,
                                                  xn_.data() + b * hidden_);
                }
                if (next) prepare(next->qkv, xn_.data(), hidden_, act_hidden_);
            }
        }
    }

    // A layer's output row times the residual scale, rounded to T (the eager layer's `h * residual_multiplier`).
    template <typename T>
    void scale_row(float* y, int64_t n) const {
        if (residual_scale_ == 1.f) return;
        for (int64_t i = 0; i < n; ++i) y[i] = conveyor::round_as<T>(y[i] * residual_scale_);
    }

    // A Mamba-2 layer's phases 1 and 2 over the pool's cache rows (mamba_row.h); int8 rows hold no state.
    template <typename T, typename C>
    void mamba_row(const conveyor::MambaSpec& m, const float* proj, C* kc, C* vc, int64_t kv_row, const int64_t* bt,
                   int64_t p, int64_t page, float* conv) {
        if constexpr (conveyor::kScaled<C>) CONVEYOR_CHECK(false, "a Mamba layer's state is not kept in int8 rows");
        else conveyor::mamba_conv_row<T, C>(m, proj, kc, vc, kv_row, bt, p, page, conv);
    }
    template <typename C>
    void mamba_head(const conveyor::MambaSpec& m, int64_t h, C* kc, C* vc, int64_t kv_row, const int64_t* bt,
                    int64_t page, bool started, const float* conv, float* y) {
        if constexpr (conveyor::kScaled<C>) CONVEYOR_CHECK(false, "a Mamba layer's state is not kept in int8 rows");
        else conveyor::mamba_state_head<C>(m, h, kc, vc, kv_row, bt, page, started, conv, y);
    }

    // Row b of a conv layer: its in_proj output (in qkv_) biased and rounded, then `short_conv_row` (the
    // product C * conv(B * x) into attn_, out_ as its accumulator, free until out_proj writes it).
    template <typename T, typename C>
    void conv_row(const Layer& L, int64_t b, C* kc, C* vc, int64_t kv_row, const int64_t* bt, int64_t p,
                  int64_t page) {
        if constexpr (conveyor::kScaled<C>) {
            CONVEYOR_CHECK(false, "a conv layer's state is kept in the model's dtype, not int8 rows");
        } else {
            float* bcx = qkv_.data() + b * 3 * hidden_;
            L.qkv.add_bias_row(bcx);
            round_row<T>(bcx, 3 * hidden_);
            const int64_t kernel = static_cast<int64_t>(L.taps.size()) / hidden_;
            conveyor::short_conv_row<T>(bcx, L.taps.data(), L.conv_bias.empty() ? nullptr : L.conv_bias.data(), kernel,
                                        hidden_, kc, vc, kv_row, bt, p, page, out_.data() + b * hidden_,
                                        attn_.data() + b * hidden_);
        }
    }

    int64_t hidden_, inter_, H_, Hkv_, D_;
    double eps_, scale_;
    int64_t max_rows_;
    std::vector<Layer> layers_;
    std::vector<float> xn_, qkv_, attn_, mid_, act_, out_;
    std::vector<float> mamba_conv_, mamba_y_;  // Mamba layers: each row's conv output, dt and decays; its y
    int64_t mamba_inner_ = 0;                  // the widest Mamba layer's heads * P (out_proj's input)
    float residual_scale_ = 1.f;
    int64_t lora_width_ = 0;                   // the widest adapter t row set
    std::vector<float> lora_t_;                // the shrink's output, [grouped rows, lora_width_]
    Activations act_hidden_, act_attn_, act_inter_, act_mamba_;
};

// The C entry points (kernels/matmul_ops.py's `DecodeStack`): a stack is built once per model and
// freed with it; errors come back as -1 (nullptr from `new`) with `conveyor_last_error`.
CONVEYOR_API void* conveyor_decode_stack_new(int64_t hidden, int64_t intermediate, int64_t heads, int64_t kv_heads,
                                             int64_t head_dim, double eps, double scale, int64_t max_rows) {
    DecodeStack* stack = nullptr;
    conveyor::guarded(1, [&] { stack = new DecodeStack(hidden, intermediate, heads, kv_heads, head_dim, eps, scale, max_rows); });
    return stack;
}

CONVEYOR_API void conveyor_decode_stack_free(void* stack) { delete static_cast<DecodeStack*>(stack); }

CONVEYOR_API int conveyor_decode_stack_add_layer(void* stack, const float* input_norm, const float* post_norm,
                                                 const conveyor::SegmentSpec* const* segments, const int64_t* counts,
                                                 const float* const* biases, int64_t group, int rope,
                                                 const float* q_norm, const float* k_norm, const float* taps,
                                                 int64_t kernel, const float* conv_bias) {
    return conveyor::guarded(1, [&] {
        static_cast<DecodeStack*>(stack)->add_layer(input_norm, post_norm, segments, counts, biases, group, rope != 0,
                                                    q_norm, k_norm, taps, kernel, conv_bias);
    });
}

CONVEYOR_API int conveyor_decode_stack_add_mamba_layer(void* stack, const float* input_norm, const float* post_norm,
                                                       const conveyor::SegmentSpec* const* segments,
                                                       const int64_t* counts, const float* const* biases,
                                                       int64_t group, int64_t heads, int64_t p, int64_t n,
                                                       int64_t groups, int64_t kernel, int64_t conv_dim,
                                                       const float* taps, const float* conv_bias, const float* a,
                                                       const float* d, const float* dt_bias, const float* norm,
                                                       float eps) {
    return conveyor::guarded(1, [&] {
        CONVEYOR_CHECK(groups > 0 && heads % groups == 0, "heads (", heads, ") must be a multiple of groups (", groups,
                       ")");
        const conveyor::MambaSpec spec{heads, p, n, groups, kernel, conv_dim, taps,
                                       conv_bias, a, d, dt_bias, norm, eps};
        static_cast<DecodeStack*>(stack)->add_mamba_layer(input_norm, post_norm, segments, counts, biases, group, spec);
    });
}

CONVEYOR_API int conveyor_decode_stack_set_sinks(void* stack, int64_t layer, const float* sinks) {
    return conveyor::guarded(1, [&] { static_cast<DecodeStack*>(stack)->set_sinks(layer, sinks); });
}

CONVEYOR_API int conveyor_decode_stack_set_moe(void* stack, int64_t layer, void* block) {
    return conveyor::guarded(1, [&] {
        static_cast<DecodeStack*>(stack)->set_moe(layer, static_cast<conveyor::MoeBlock*>(block));
    });
}

CONVEYOR_API int conveyor_decode_stack_set_residual_scale(void* stack, float scale) {
    return conveyor::guarded(1, [&] { static_cast<DecodeStack*>(stack)->set_residual_scale(scale); });
}

CONVEYOR_API int conveyor_decode_stack_forward(void* stack, float* x, int64_t B, const float* cos, const float* sin,
                                               int dtype, int kv_dtype, void* const* kv, const int64_t* kv_slots,
                                               int64_t num_kv,
                                               const int64_t* const* tables, const int64_t* widths,
                                               const int64_t* const* lens, const int64_t* const* slots,
                                               const int64_t* windows, int64_t groups, const int64_t* positions,
                                               int64_t page_size, int threads, int shared_rows,
                                               const int64_t* lora_order, const int64_t* lora_groups,
                                               int64_t lora_n_groups) {
    return conveyor::guarded(threads, [&] {
        static_cast<DecodeStack*>(stack)->forward(x, B, cos, sin, dtype, kv_dtype, kv, kv_slots, num_kv, tables, widths, lens,
                                                  slots, windows, groups, positions, page_size, threads, shared_rows != 0,
                                                  conveyor::LoRAGroups{lora_order, lora_groups, lora_n_groups});
    });
}

CONVEYOR_API int conveyor_decode_stack_set_lora(void* stack, int64_t layer, int64_t projection, int dtype, const void* a,
                                                const void* b, const int64_t* slice_rows, const int64_t* slice_block,
                                                int64_t n_slices, int64_t rank, int64_t blocks) {
    return conveyor::guarded(1, [&] {
        static_cast<DecodeStack*>(stack)->set_lora(layer, projection, dtype, a, b, slice_rows, slice_block, n_slices,
                                                   rank, blocks);
    });
}
