// A mixture-of-experts block natively (`MoeBlock`, moe_cpu.cpp): the router, the routing, the experts grouped by
// expert, the shared expert and the weighted sum, run by the threads of an OpenMP parallel region.
//
// One implementation serves two callers: the eager layer (`forward`: one call per layer and step, its own
// parallel region) and the native decode stack (`run`, called by every thread of the stack's region between
// its other phases), so a decode row gets the same bits on either path. The router is a linear of the kernels'
// F32 tiles (its logits fp32; the shared expert's gate logit, where there is one, as an extra row), each row's
// routing is computed here (`RouteKind`: the families' four rules), and the rest is what the grouped experts
// did before the router joined them: every busy expert's rows gathered and prepared, all gate/up products
// split into (expert, tile range) items, the activation, all down products, then each row's output times its
// weight added to its token's fp32 sum in the sorted order (expert by expert, tokens in batch order), the
// shared expert's output (times its sigmoid gate) added last, the sum rounded to the model's dtype.
#pragma once

#include "quant.h"
#include "tiled_linear.h"

#include <vector>

namespace conveyor {

// How a row's router logits choose its experts and weigh them (layers/moe.py names each after its family).
enum RouteKind : int {
    kRouteSoftmax = 0,      // softmax over all experts, the top k (renormalized where set): Mixtral, Qwen-MoE
    kRouteTopkSoftmax = 1,  // the top k logits, a softmax over those k: gpt-oss, Granite
    kRouteBiased = 2,       // softmax, the top k of it plus a bias chosen, divided by max(sum, norm_min): ERNIE
    kRouteSigmoid = 3,      // sigmoid scores (plus a bias to choose), renormalized where set, times scale: LFM2
};

struct MoeRouting {
    int kind = kRouteSoftmax;
    int64_t top_k = 1;
    bool renormalize = false;
    float norm_min = 0.f, scale = 1.f;
    std::vector<float> bias;  // a per-expert bias added only to choose (empty: none)
};

class MoeBlock {
  public:
    // `limit` > 0: gpt-oss's clamped SwiGLU with `alpha` (tiled_linear.h); else SiLU * up.
    MoeBlock(int64_t hidden, int64_t intermediate, double alpha, double limit);

    // One expert's gate/up (gate rows first) and down, as row segments, and their fp32 biases (copied, or nullptr).
    void add_expert(const SegmentSpec* gate_up, int64_t n_gate_up, const SegmentSpec* down, int64_t n_down,
                    const float* gate_up_bias, const float* down_bias);
    // The router (F32 tiles of one row per expert, then the shared expert's gate row where `shared_gate`), its
    // bias (or nullptr) and the routing rule; called after the experts.
    void set_router(const SegmentSpec* parts, int64_t n_parts, const float* bias, const MoeRouting& routing,
                    bool shared_gate);
    // The shared expert's gate/up and down (`intermediate` wide), taking every row.
    void set_shared(const SegmentSpec* gate_up, int64_t n_gate_up, const SegmentSpec* down, int64_t n_down,
                    int64_t intermediate);

    // Sizes the scratch for `rows` token rows (before the parallel region that runs them); `routed`: the caller
    // gives each row's experts and weights (`set_routes`) and adds the shared expert itself.
    void begin(int64_t rows, bool routed = false);
    void set_routes(const float* weights, const int64_t* ids);  // [rows, top_k] each, after `begin(rows, true)`
    // Every thread of a parallel region: out [rows, hidden] (row stride ldo) = the block over x [rows, hidden]
    // (fp32 values, T-exact; row stride ldx), rounded to T. Has barriers: all threads must call it.
    template <typename T>
    void run(const float* x, int64_t ldx, float* out, int64_t ldo, int tid, int nt);
    // The eager layer's call: x [rows, hidden] of `dtype` (kF32 or kBF16) through the block into out (fp32,
    // T-exact); with `weights` and `ids` the given routing instead of the router's, and out the experts' fp32
    // sum alone (no shared expert, not rounded).
    void forward(int dtype, const void* x, int64_t rows, float* out, int threads, const float* weights,
                 const int64_t* ids);

    int64_t hidden() const { return hidden_; }
    int64_t num_experts() const { return static_cast<int64_t>(experts_.size()); }
    const std::vector<int64_t>& counts() const { return counts_; }  // the last call's rows per expert

  private:
    struct Expert {
        Linear gate_up, down;
    };
    struct WorkItem {
        int64_t expert, u0, u1;
    };

    void select(const float* logits, float* weights, int64_t* ids, std::vector<float>& scores) const;
    void group(int nt);  // the sorted rows and the work items, on one thread
    template <typename T>
    void combine(float* out, int64_t ldo, int tid, int nt);
    bool shared() const { return shared_up_.N > 0; }

    int64_t hidden_, inter_, shared_inter_ = 0;
    float alpha_, limit_;
    std::vector<Expert> experts_;
    Linear router_, shared_up_, shared_down_;
    MoeRouting routing_;
    bool shared_gate_ = false;
    // one call's state
    int64_t rows_ = 0;
    bool routed_ = false;
    std::vector<float> logits_, weights_, gates_, shared_mid_, shared_act_, shared_out_, xf_;
    std::vector<int64_t> ids_, counts_, start_, tokens_, row_expert_;
    std::vector<float> row_weights_, mid_, act_, y_;
    std::vector<WorkItem> up_items_, down_items_;
    Activations router_in_, shared_in_, shared_down_in_;
    std::vector<Activations> in_, mid_in_;
};

}  // namespace conveyor
