// A step of a Llama-family model (Llama, Mistral, Qwen2, Qwen3) or Gemma 3 as one C++ call: every decoder layer (RMSNorm, q/k/v projection, per-head RMSNorm (Qwen3, Gemma 3),
// rotary embedding, paged attention with its K/V write, output projection, Gemma's norm of
// it, residual, RMSNorm, gate/up projection, SiLU or tanh-GELU and multiply, down projection,
// Gemma's norm of it, residual), the final norm and the LM head, float32 activations.
// transformers' modeling code stays the reference and the path of every other model
// (asyncllm/worker/native_forward.py decides and builds the Decoder).
//
// The linears and the attention are the ops every other path calls (asyncllm::int4_linear,
// asyncllm::q8_0_linear, asyncllm::paged_attention, aten::linear), reached through torch's
// dispatcher with the same arguments as the layers' own forwards, so they compute the same
// bits; what this file computes itself is the elementwise glue between them, which eager
// runs as ~10 ATen calls per layer and a compiled graph as Inductor kernels. At batch 1 that
// glue and the Python around ~270 op calls cost as much as the weights' reads
// (docs/tuning.md, "Native forward").
//
// Formulas (transformers' modeling_llama.py, modeling_qwen3.py, modeling_gemma3.py):
//   RMSNorm(x) = w * (x * rsqrt(mean(x^2) + eps))   (Gemma: w = 1 + its weight, in float32)
//   rotary(q)[i] = q[i] cos[i] - q[i + D/2] sin[i]      (i < D/2)
//                = q[i] cos[i] + q[i - D/2] sin[i]      (i >= D/2)
//   SiLU(g) * u = g / (1 + exp(-g)) * u
//   GELU_tanh(g) * u = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) * u
// Compiled with -ffast-math (exp vectorized through glibc's libmvec; sums reassociated):
// the same function as float32 eager, not always its last bit.
#include "common.h"
#include "python_module.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

// How a linear layer is called (asyncllm/worker/native_forward.py: linear_spec).
enum Kind : int64_t {
  INT4 = 0,    // asyncllm::int4_linear(x, packed, scales_and_zeros, bias?, 5 ints)
  Q8 = 1,      // asyncllm::q8_0_linear(x, q, scale, packed?, bias?, max_rows, logits, offset?)
  DENSE = 2,   // aten::linear(x, weight, bias?)
  MODULE = 3,  // the module itself, called back in Python (any other layer type)
};

struct Linear {
  int64_t kind = MODULE;
  std::vector<OptTensor> t;
  std::vector<int64_t> n;
  pybind11::object module;
};

const auto& int4_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("asyncllm::int4_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const OptTensor&, int64_t, int64_t, int64_t, int64_t, int64_t)>();
  return op;
}

const auto& q8_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("asyncllm::q8_0_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const OptTensor&, const OptTensor&, int64_t, bool, const OptTensor&)>();
  return op;
}

const auto& attention_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("asyncllm::paged_attention", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, int64_t, double, int64_t,
                                               double)>();
  return op;
}

// x [B, K] -> [B, N] contiguous.
at::Tensor run(const Linear& l, const at::Tensor& x) {
  at::Tensor y;
  switch (l.kind) {
    case INT4:
      y = int4_op().call(x, *l.t[0], *l.t[1], l.t[2], l.n[0], l.n[1], l.n[2], l.n[3], l.n[4]);
      break;
    case Q8:
      y = q8_op().call(x, *l.t[0], *l.t[1], l.t[2], l.t[3], l.n[0], l.n[1] != 0, l.t[4]);
      break;
    case DENSE:
      y = at::linear(x, *l.t[0], l.t[1]);
      break;
    default: {
      pybind11::gil_scoped_acquire gil;
      y = l.module(x).cast<at::Tensor>();
    }
  }
  return y.contiguous();
}

// out may be x (in place): each element is read before it is written.
void rms_norm(const float* x, const float* __restrict w, int64_t n, float eps, float* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

// One head's D values (row x), RMS-normed first where w is given, rotated by cos/sin [D].
void rotate(const float* __restrict x, const float* w, float eps, const float* __restrict c,
            const float* __restrict s, int64_t D, float* __restrict tmp, float* __restrict out) {
  if (w != nullptr) {
    rms_norm(x, w, D, eps, tmp);
    x = tmp;
  }
  const int64_t h = D / 2;
  for (int64_t i = 0; i < h; ++i) out[i] = x[i] * c[i] - x[i + h] * s[i];
  for (int64_t i = h; i < D; ++i) out[i] = x[i] * c[i] + x[i - h] * s[i];
}

// Rows [0, B) of work, on torch's threads where the batch is large enough to pay for them.
template <typename F>
void over_rows(int64_t B, int64_t width, const F& f) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1));
  if (B <= grain) {
    f(0, B);
    return;
  }
  at::parallel_for(0, B, grain, f);
}

enum Act : int64_t { SILU = 0, GELU_TANH = 1 };

struct Layer {
  at::Tensor in_norm, ffn_norm;      // before the attention, before the MLP
  OptTensor attn_out_norm, ffn_out_norm;  // Gemma: on each block's output, before the residual
  OptTensor q_norm, k_norm;  // Qwen3, Gemma 3: per-head RMSNorm of q and k before the rotation
  std::vector<Linear> qkv;   // columns q | k | v: one fused call, a fused pair and one, or three
  Linear o;
  std::vector<Linear> gate_up;  // one fused (columns gate | up) or two
  Linear down;
  int64_t index = 0, window = 0, rope = 0, act = SILU;  // rope: which cos/sin pair
  double scale = 1.0;
};

// g [n] -> act(g) * u into out.
void act_mul(int64_t act, const float* __restrict g, const float* __restrict u, int64_t n,
             float* __restrict out) {
  if (act == SILU) {
    for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    return;
  }
  constexpr float beta = 0.7978845608028654f;  // sqrt(2 / pi)
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i];
    // tanh(y) = 1 - 2 / (exp(2y) + 1), y clamped where tanh is +-1 in float32 (no inf)
    const float y = std::min(std::max(beta * (x + 0.044715f * x * x * x), -20.f), 20.f);
    const float t = 1.f - 2.f / (std::exp(2.f * y) + 1.f);
    out[i] = 0.5f * x * (1.f + t) * u[i];
  }
}

class Decoder {
 public:
  Decoder(std::vector<Layer> layers, at::Tensor final_norm, Linear head, double eps, int64_t hq,
          int64_t hkv, int64_t head_dim)
      : layers_(std::move(layers)),
        final_norm_(std::move(final_norm)),
        head_(std::move(head)),
        eps_(static_cast<float>(eps)),
        hq_(hq),
        hkv_(hkv),
        d_(head_dim) {
    TORCH_CHECK(d_ % 2 == 0, "Decoder: the head size must be even (rotary halves)");
    hidden_ = final_norm_.size(0);
    auto f32 = [](const at::Tensor& t) {
      return t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 1;
    };
    TORCH_CHECK(f32(final_norm_), "Decoder: norms are contiguous float32 vectors");
    for (const Layer& l : layers_) {
      for (const OptTensor& t : {OptTensor(l.in_norm), OptTensor(l.ffn_norm), l.attn_out_norm,
                                 l.ffn_out_norm})
        TORCH_CHECK(!t || (f32(*t) && t->size(0) == hidden_),
                    "Decoder: a layer's norms are float32 [hidden]");
      TORCH_CHECK(l.act == SILU || l.act == GELU_TANH, "Decoder: unknown activation ", l.act);
      TORCH_CHECK(l.rope >= 0, "Decoder: a negative rotary index");
      for (const OptTensor& t : {l.q_norm, l.k_norm})
        TORCH_CHECK(!t || (f32(*t) && t->size(0) == d_), "Decoder: head norms are float32 [D]");
      TORCH_CHECK(!l.qkv.empty() && l.qkv.size() <= 3, "Decoder: q/k/v as one to three calls");
      TORCH_CHECK(l.gate_up.size() == 1 || l.gate_up.size() == 2,
                  "Decoder: gate/up as one call or two");
    }
  }

  // hidden [B, hidden] float32 (the embedded tokens), cos/sin: per rotary kind (a layer's
  // rope index) [B, D] float32 (the rotary embedding at each row's position), keep [R] int64
  // (the rows whose logits are returned) -> logits [R, vocab]. Runs inside the runner's
  // step_metadata (the attention's caches).
  at::Tensor step(const at::Tensor& hidden, std::vector<at::Tensor> cos,
                  std::vector<at::Tensor> sin, const at::Tensor& keep) const {
    TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat &&
                    hidden.size(1) == hidden_,
                "Decoder.step: hidden must be float32 [B, ", hidden_, "]");
    const int64_t B = hidden.size(0);
    TORCH_CHECK(cos.size() == sin.size(), "Decoder.step: one sin per cos");
    for (size_t i = 0; i < cos.size(); ++i) {
      cos[i] = cos[i].contiguous(), sin[i] = sin[i].contiguous();
      TORCH_CHECK(cos[i].scalar_type() == at::kFloat && sin[i].scalar_type() == at::kFloat &&
                      cos[i].sizes() == at::IntArrayRef({B, d_}) &&
                      cos[i].sizes() == sin[i].sizes(),
                  "Decoder.step: cos and sin must be float32 [B, D]");
    }
    at::Tensor x = hidden.contiguous().clone();  // the residual stream
    at::Tensor h = at::empty_like(x);
    const auto opts = x.options();
    for (const Layer& l : layers_) {
      TORCH_CHECK(l.rope < static_cast<int64_t>(cos.size()), "Decoder.step: no rotary ", l.rope);
      norm_rows(x, l.in_norm, h);
      at::Tensor q = at::empty({B, hq_, d_}, opts), k = at::empty({B, hkv_, d_}, opts),
                 v = at::empty({B, hkv_, d_}, opts);
      project_qkv(l, h, cos[l.rope], sin[l.rope], q, k, v);
      // softcap 0: no family here soft-caps attention (native_forward.py)
      const at::Tensor a = attention_op().call(q, k, v, l.index, l.scale, l.window, 0.0);
      add_rows(x, normed(run(l.o, a.reshape({B, hq_ * d_})), l.attn_out_norm));
      norm_rows(x, l.ffn_norm, h);
      add_rows(x, normed(run(l.down, act_mul_rows(l, h)), l.ffn_out_norm));
    }
    norm_rows(x, final_norm_, h);
    const bool all = keep.numel() == B &&
                     at::equal(keep, at::arange(B, keep.options()));
    return run(head_, all ? h : h.index_select(0, keep));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  void norm_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& out) const {
    TORCH_CHECK(x.size(1) == hidden_ && x.is_contiguous() && x.scalar_type() == at::kFloat,
                "Decoder: a projection returned ", x.sizes());
    const int64_t B = x.size(0), n = hidden_;
    const float *px = x.data_ptr<float>(), *pw = w.data_ptr<float>();
    float* po = out.data_ptr<float>();
    over_rows(B, n, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) rms_norm(px + b * n, pw, n, eps_, po + b * n);
    });
  }

  // y RMS-normed in place by w where given.
  at::Tensor normed(at::Tensor y, const OptTensor& w) const {
    if (w) norm_rows(y, *w, y);
    return y;
  }

  static void add_rows(at::Tensor& x, const at::Tensor& y) {
    TORCH_CHECK(y.sizes() == x.sizes() && y.scalar_type() == at::kFloat,
                "Decoder: a projection returned ", y.sizes(), " for ", x.sizes());
    const int64_t n = x.numel();
    float* px = x.data_ptr<float>();
    const float* py = y.data_ptr<float>();
    over_rows(n / x.size(1), x.size(1), [&](int64_t b0, int64_t b1) {
      const int64_t w = x.size(1);
      for (int64_t i = b0 * w; i < b1 * w; ++i) px[i] = px[i] + py[i];
    });
  }

  // q, k, v [B, H(kv), D]: the projections' columns, q and k normed per head where the
  // layer has head norms and rotated; v copied.
  void project_qkv(const Layer& l, const at::Tensor& h, const at::Tensor& c,
                   const at::Tensor& s, at::Tensor& q, at::Tensor& k, at::Tensor& v) const {
    const int64_t B = h.size(0), D = d_, nq = hq_ * D, nkv = hkv_ * D;
    std::vector<at::Tensor> ys;
    for (const Linear& lin : l.qkv) ys.push_back(run(lin, h));
    // (first column, row stride) of q, k and v: the calls' outputs side by side are the
    // columns q | k | v (one fused call, three, or a fused pair and one).
    const float* src[3];
    int64_t stride[3];
    const int64_t width[3] = {nq, nkv, nkv};
    size_t yi = 0;
    int64_t col = 0;
    for (int i = 0; i < 3; ++i) {
      TORCH_CHECK(yi < ys.size(), "Decoder: q/k/v projections return too few columns");
      const at::Tensor& y = ys[yi];
      TORCH_CHECK(y.dim() == 2 && y.size(0) == B && col + width[i] <= y.size(1) &&
                      y.scalar_type() == at::kFloat,
                  "Decoder: q/k/v projection returned ", y.sizes());
      src[i] = y.data_ptr<float>() + col;
      stride[i] = y.size(1);
      col += width[i];
      if (col == y.size(1)) ++yi, col = 0;
    }
    TORCH_CHECK(yi == ys.size(), "Decoder: q/k/v projections return too many columns");
    const float* wq = l.q_norm ? l.q_norm->data_ptr<float>() : nullptr;
    const float* wk = l.k_norm ? l.k_norm->data_ptr<float>() : nullptr;
    float *pq = q.data_ptr<float>(), *pk = k.data_ptr<float>(), *pv = v.data_ptr<float>();
    const float *pc = c.data_ptr<float>(), *ps = s.data_ptr<float>();
    over_rows(B, nq + 2 * nkv, [&](int64_t b0, int64_t b1) {
      std::vector<float> tmp(D);
      for (int64_t b = b0; b < b1; ++b) {
        const float *cb = pc + b * D, *sb = ps + b * D;
        for (int64_t hh = 0; hh < hq_; ++hh)
          rotate(src[0] + b * stride[0] + hh * D, wq, eps_, cb, sb, D, tmp.data(),
                 pq + (b * hq_ + hh) * D);
        for (int64_t hh = 0; hh < hkv_; ++hh)
          rotate(src[1] + b * stride[1] + hh * D, wk, eps_, cb, sb, D, tmp.data(),
                 pk + (b * hkv_ + hh) * D);
        std::memcpy(pv + b * nkv, src[2] + b * stride[2], nkv * sizeof(float));
      }
    });
  }

  // act(gate) * up [B, I] of the normed rows h.
  at::Tensor act_mul_rows(const Layer& l, const at::Tensor& h) const {
    std::vector<at::Tensor> ys;
    for (const Linear& lin : l.gate_up) ys.push_back(run(lin, h));
    const int64_t B = h.size(0);
    const int64_t I = ys.size() == 1 ? ys[0].size(1) / 2 : ys[0].size(1);
    for (const at::Tensor& y : ys)
      TORCH_CHECK(y.dim() == 2 && y.size(0) == B && y.scalar_type() == at::kFloat &&
                      y.size(1) == (ys.size() == 1 ? 2 * I : I),
                  "Decoder: gate/up projection returned ", y.sizes());
    at::Tensor out = at::empty({B, I}, h.options());
    const float* g = ys[0].data_ptr<float>();
    const float* u = ys.size() == 1 ? g + I : ys[1].data_ptr<float>();
    const int64_t stride = ys[0].size(1);
    float* po = out.data_ptr<float>();
    over_rows(B, I, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) act_mul(l.act, g + b * stride, u + b * stride, I, po + b * I);
    });
    return out;
  }

  std::vector<Layer> layers_;
  at::Tensor final_norm_;
  Linear head_;
  float eps_;
  int64_t hq_, hkv_, d_, hidden_ = 0;
};

}  // namespace

// Nothing to register: the decoder calls the other families' ops.
void register_ops() {}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("register_ops", &register_ops, "No op kernels of its own (the loader calls it).");
  m.attr("INT4") = static_cast<int64_t>(INT4);
  m.attr("Q8") = static_cast<int64_t>(Q8);
  m.attr("DENSE") = static_cast<int64_t>(DENSE);
  m.attr("MODULE") = static_cast<int64_t>(MODULE);
  m.attr("SILU") = static_cast<int64_t>(SILU);
  m.attr("GELU_TANH") = static_cast<int64_t>(GELU_TANH);
  py::class_<Linear>(m, "Linear")
      .def(py::init([](int64_t kind, std::vector<OptTensor> t, std::vector<int64_t> n,
                       py::object module) {
             const size_t want_t[] = {3, 5, 2, 0}, want_n[] = {5, 2, 0, 0};
             TORCH_CHECK(kind >= INT4 && kind <= MODULE, "Linear: unknown kind ", kind);
             TORCH_CHECK(t.size() == want_t[kind] && n.size() == want_n[kind],
                         "Linear: kind ", kind, " takes ", want_t[kind], " tensors and ",
                         want_n[kind], " ints");
             TORCH_CHECK(kind != MODULE || !module.is_none(), "Linear: MODULE needs a module");
             return Linear{kind, std::move(t), std::move(n), std::move(module)};
           }),
           py::arg("kind"), py::arg("tensors"), py::arg("ints"), py::arg("module") = py::none());
  py::class_<Layer>(m, "Layer")
      .def(py::init([](at::Tensor in_norm, at::Tensor ffn_norm, OptTensor attn_out_norm,
                       OptTensor ffn_out_norm, OptTensor q_norm, OptTensor k_norm,
                       std::vector<Linear> qkv, Linear o, std::vector<Linear> gate_up,
                       Linear down, int64_t index, double scale, int64_t window, int64_t rope,
                       int64_t act) {
             Layer l;
             l.in_norm = std::move(in_norm), l.ffn_norm = std::move(ffn_norm);
             l.attn_out_norm = std::move(attn_out_norm), l.ffn_out_norm = std::move(ffn_out_norm);
             l.q_norm = std::move(q_norm), l.k_norm = std::move(k_norm);
             l.qkv = std::move(qkv), l.o = std::move(o);
             l.gate_up = std::move(gate_up), l.down = std::move(down);
             l.index = index, l.window = window, l.rope = rope, l.act = act;
             l.scale = scale;
             return l;
           }),
           py::arg("in_norm"), py::arg("ffn_norm"), py::arg("attn_out_norm"),
           py::arg("ffn_out_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("qkv"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("index"), py::arg("scale"),
           py::arg("window"), py::arg("rope"), py::arg("act"));
  py::class_<Decoder>(m, "Decoder")
      .def(py::init<std::vector<Layer>, at::Tensor, Linear, double, int64_t, int64_t, int64_t>(),
           py::arg("layers"), py::arg("final_norm"), py::arg("head"), py::arg("eps"),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"))
      .def("step", &Decoder::step, py::arg("hidden"), py::arg("cos"), py::arg("sin"),
           py::arg("keep"), py::call_guard<py::gil_scoped_release>(),
           "logits [R, vocab] of the decode step (see the C++ comment)")
      .def_property_readonly("num_layers", &Decoder::num_layers);
}
