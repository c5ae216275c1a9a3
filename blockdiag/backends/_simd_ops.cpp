// The simd kernels as C++ torch operators: blockdiag::simd_native and
// blockdiag::simd_native_backward (see _simd_ops.py, which builds and loads this file).
//
// simd's Python wrapper checks each operand, allocates the result and calls the C kernels
// through ctypes, which at small sizes costs more than the product itself (`blockdiag bench`
// measures it). Here the same checks, allocations and calls run in C++, reached from Python
// through one dispatcher call each.
//
// These ops are simd's kernels, not a second backend: they run below autograd, inside
// simd's op or autograd Function (the backward is their own op); a call autograd records
// gets a node that raises if a gradient reaches it (see record_refusal). The C kernels are
// the ones simd loaded and self-checked: Python hands their addresses over (bd_ops_set)
// only after the dtype's self-check passed, and takes them back (bd_ops_clear) when it
// loads another library.
//
// Anything the kernels cannot take in place is refused with an error, never run: the
// Python wrapper then takes the operands, and either runs them or raises the precise
// BlockDiagError. So every check here may be coarser than Python's, never looser.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <memory>
#include <type_traits>

#if !defined(BD_BLAS_GRADS_MIN_BLOCK) || !defined(BD_BLAS_WEIGHT_GRAD_MIN_BLOCK) ||        \
    !defined(BD_BLAS_WEIGHT_GRAD_MAX_ROWS) || !defined(BD_BLAS_WEIGHT_GRAD_MIN_GROUPS) ||   \
    !defined(BD_BLAS_WEIGHT_GRAD_MANY_GROUPS) || !defined(BD_BLAS_WEIGHT_GRAD_MANY_MAX_ROWS) || \
    !defined(BD_BLAS_WEIGHT_GRAD_MANY_MIN_IN)
#error "BD_BLAS_* are defined by the build command in _simd_ops.py (BLAS_GRADS_MIN_BLOCK, BLAS_WEIGHT_GRAD_*)"
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

// The C kernels' signatures (see _simd_body.h).
using forward_fn = int (*)(const void*, int64_t, const void*, const void*, void*, int64_t, int64_t, int64_t,
                           int64_t, int64_t, int);
using grad_input_fn = int (*)(const void*, int64_t, const void*, void*, int64_t, int64_t, int64_t, int64_t,
                              int64_t, int);
using grad_weight_fn = int (*)(const void*, int64_t, const void*, int64_t, void*, void*, int64_t, int64_t,
                               int64_t, int64_t, int);

struct Kernels {
  std::atomic<forward_fn> forward{nullptr};
  std::atomic<grad_input_fn> grad_input{nullptr};
  std::atomic<grad_weight_fn> grad_weight{nullptr};
};

Kernels kernels[2];  // float32, float64

// The kernels of t's dtype, each pointer loaded once: bd_ops_clear may run on another thread
// between a check and a later load of the same pointer, which would then be null. Libraries
// are never unloaded, so a snapshot stays callable after it is cleared.
struct KernelSet {
  forward_fn forward;
  grad_input_fn grad_input;
  grad_weight_fn grad_weight;
};

KernelSet kernels_for(const at::Tensor& t, const char* op) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, "blockdiag::", op, ": the kernels run float32 and float64, got ",
              dtype);
  Kernels& k = kernels[dtype == at::kFloat ? 0 : 1];
  const KernelSet set{k.forward.load(), k.grad_input.load(), k.grad_weight.load()};
  TORCH_CHECK(set.forward != nullptr && set.grad_input != nullptr && set.grad_weight != nullptr, "blockdiag::", op,
              ": the ", dtype, " kernels are not loaded and self-checked in this process");
  return set;
}

// A CPU strided tensor of dtype, without a lazy negation or conjugation, whose storage is
// allocated and holds every element of the view.
at::Tensor operand(const char* op, const char* arg, const at::Tensor& t, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.layout() == at::kStrided, "blockdiag::", op, ": ", arg,
              " must be a strided CPU tensor, got ", t.device(), " ", t.layout());
  TORCH_CHECK(t.scalar_type() == dtype, "blockdiag::", op, ": ", arg, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(!t.is_neg() && !t.is_conj(), "blockdiag::", op, ": ", arg, " is a lazily negated or conjugated view");
  if (t.numel() == 0) {
    return t;
  }
  TORCH_CHECK(t.has_storage() && t.storage().data() != nullptr, "blockdiag::", op, ": ", arg,
              " has no allocated storage");
  int64_t end = t.storage_offset() + 1;
  for (int64_t d = 0; d < t.dim(); ++d) {
    TORCH_CHECK(t.stride(d) >= 0, "blockdiag::", op, ": ", arg, " has a negative stride");
    end += (t.size(d) - 1) * t.stride(d);
  }
  TORCH_CHECK(static_cast<int64_t>(t.storage().nbytes()) >= end * static_cast<int64_t>(t.element_size()),
              "blockdiag::", op, ": ", arg, " has no storage for its elements");
  return t;
}

// A 2-d operand as the kernels read it: in place when its columns are adjacent and its rows
// 0 or at least a width apart, else its contiguous copy; and its leading dimension.
std::pair<at::Tensor, int64_t> matrix(const char* op, const char* arg, const at::Tensor& t, at::ScalarType dtype) {
  operand(op, arg, t, dtype);
  const int64_t rows = t.size(0), width = t.size(1), ld = t.stride(0), unit = t.stride(1);
  if ((width > 1 && unit != 1) || (rows > 1 && 0 < ld && ld < width)) {
    return {t.contiguous(), rows > 1 ? width : std::max<int64_t>(width, 1)};
  }
  return {t, rows > 1 ? ld : std::max<int64_t>(width, 1)};
}

void ran(int code, const char* op, const char* what) {
  TORCH_CHECK(code == 0, "blockdiag::", op, ": the ", what, " kernel returned ", code);
}

at::Tensor forward(const at::Tensor& x_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in) {
  constexpr const char* op = "simd_native";
  TORCH_CHECK(x_in.dim() == 2 && weight_in.dim() == 3, "blockdiag::", op, ": input must be 2-d and weight 3-d, got ",
              x_in.sizes(), " and ", weight_in.sizes());
  const KernelSet k = kernels_for(x_in, op);
  const auto dtype = x_in.scalar_type();
  const int64_t g = weight_in.size(0), o = weight_in.size(1), i = weight_in.size(2), n = x_in.size(0);
  TORCH_CHECK(x_in.size(1) == g * i && g * i > 0 && o > 0, "blockdiag::", op, ": input ", x_in.sizes(),
              " does not match weight ", weight_in.sizes());
  auto [x, ldx] = matrix(op, "input", x_in, dtype);
  const at::Tensor weight = operand(op, "weight", weight_in, dtype).contiguous();
  at::Tensor bias;
  if (bias_in.has_value()) {
    TORCH_CHECK(bias_in->dim() == 1 && bias_in->size(0) == g * o, "blockdiag::", op, ": bias must be [", g * o,
                "], got ", bias_in->sizes());
    bias = operand(op, "bias", *bias_in, dtype).contiguous();
  }
  at::Tensor y = at::empty({n, g * o}, x.options());
  ran(k.forward(x.const_data_ptr(), ldx, weight.const_data_ptr(), bias.defined() ? bias.const_data_ptr() : nullptr,
                       y.mutable_data_ptr(), g * o, n, g, i, o, at::get_num_threads()),
      op, "forward");
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& gy_in, const at::Tensor& x_in,
                                                        const at::Tensor& weight_in, bool has_bias, bool need_input,
                                                        bool need_weight) {
  constexpr const char* op = "simd_native_backward";
  TORCH_CHECK(gy_in.dim() == 2 && x_in.dim() == 2 && weight_in.dim() == 3, "blockdiag::", op,
              ": grad and input must be 2-d and weight 3-d, got ", gy_in.sizes(), ", ", x_in.sizes(), " and ",
              weight_in.sizes());
  const KernelSet k = kernels_for(gy_in, op);
  const auto dtype = gy_in.scalar_type();
  const int64_t g = weight_in.size(0), o = weight_in.size(1), i = weight_in.size(2), n = gy_in.size(0);
  TORCH_CHECK(gy_in.size(1) == g * o && x_in.size(0) == n && x_in.size(1) == g * i && g * i > 0 && o > 0,
              "blockdiag::", op, ": grad ", gy_in.sizes(), " and input ", x_in.sizes(), " do not match weight ",
              weight_in.sizes());
  // Read by the input gradient only: without it the weight may be a one-value stand-in
  // (ops/_define.py, kept_weight_for_backward), which a contiguous copy would fill.
  const at::Tensor weight = need_input ? operand(op, "weight", weight_in, dtype).contiguous()
                                       : operand(op, "weight", weight_in, dtype);
  auto [gy, ldg] = matrix(op, "grad", gy_in, dtype);
  // A gradient not asked for comes back with 0 elements (an op cannot return None).
  at::Tensor gx = at::empty({0}, gy.options()), gw = at::empty({0}, gy.options()), gb = at::empty({0}, gy.options());
  // Where the gradients are torch's BLAS products, they are the same calls as simd's ctypes
  // path (simd.py, _blas_backward), so both routes agree bitwise; blas_grads in _simd_ops.py
  // is the rule and says why.
  const bool blas_input = i * o >= BD_BLAS_GRADS_MIN_BLOCK;
  const bool blas_weight =
      blas_input || (i * o >= BD_BLAS_WEIGHT_GRAD_MIN_BLOCK &&
                     ((n <= BD_BLAS_WEIGHT_GRAD_MAX_ROWS && g >= BD_BLAS_WEIGHT_GRAD_MIN_GROUPS) ||
                      (n <= BD_BLAS_WEIGHT_GRAD_MANY_MAX_ROWS && g >= BD_BLAS_WEIGHT_GRAD_MANY_GROUPS &&
                       i >= BD_BLAS_WEIGHT_GRAD_MANY_MIN_IN)));
  if (need_input && blas_input) {
    gx = at::empty({n, g * i}, gy.options());
    for (int64_t k = 0; k < g; k++) {
      at::Tensor slice = gx.narrow(1, k * i, i);
      at::mm_out(slice, gy.narrow(1, k * o, o), weight.select(0, k));
    }
  } else if (need_input) {
    gx = at::empty({n, g * i}, gy.options());
    ran(k.grad_input(gy.const_data_ptr(), ldg, weight.const_data_ptr(), gx.mutable_data_ptr(), g * i, n, g, i, o,
                            at::get_num_threads()),
        op, "input gradient");
  }
  if (need_weight && blas_weight) {
    auto [x, ldx] = matrix(op, "input", x_in, dtype);
    gw = at::bmm(gy.view({n, g, o}).permute({1, 2, 0}), x.view({n, g, i}).transpose(0, 1));
    if (has_bias) {
      gb = at::sum(gy, {0});
    }
  } else if (need_weight) {
    auto [x, ldx] = matrix(op, "input", x_in, dtype);
    gw = at::empty({g, o, i}, gy.options());
    if (has_bias) {
      gb = at::empty({g * o}, gy.options());
    }
    ran(k.grad_weight(gy.const_data_ptr(), ldg, x.const_data_ptr(), ldx, gw.mutable_data_ptr(),
                             has_bias ? gb.mutable_data_ptr() : nullptr, n, g, i, o, at::get_num_threads()),
        op, "weight gradient");
  } else if (has_bias) {
    gb = at::sum(gy, {0});
  }
  return {gx, gw, gb};
}

// The Autograd kernels. These ops have no derivative of their own (simd's op and Function
// hold it). A call with a forward-mode tangent is refused: the tangent would be dropped. A
// call autograd records runs, and its outputs get an Error node that raises when a gradient
// reaches it: never a silently missing gradient. Recording alone is not refused, because
// torch's higher-order ops (scan) re-trace graphs that already hold these ops
// with grad mode on and grad-requiring operands (functionalizing a joint graph that simd's
// Function differentiated), then never differentiate that re-trace. Any other call is passed
// below autograd, to the CPU kernel, a fake kernel or a mode.
bool refuse_tangents_and_record(const char* op, std::initializer_list<const at::Tensor*> tensors) {
  const bool grad = c10::GradMode::is_enabled();
  bool record = false;
  for (const at::Tensor* t : tensors) {
    if (t == nullptr || !t->defined()) {
      continue;
    }
    TORCH_CHECK(!t->_fw_grad(/*level=*/0).defined(), "blockdiag::", op,
                " is one of simd's kernels and has no forward-mode derivative: call it on tensors without "
                "a forward-mode tangent, or run simd through blockdiag (backend=\"simd\"), whose op "
                "differentiates it");
    record = record || (grad && t->requires_grad());
  }
  return record;
}

// An autograd node held as torch's headers hold one: c10::intrusive_ptr from torch 2.13,
// std::shared_ptr before (the branch not taken is never instantiated).
template <class N>
auto make_node(std::string msg, torch::autograd::edge_list&& edges) {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, N>) {
    return c10::make_intrusive<N>(std::move(msg), std::move(edges));
  } else {
    return std::make_shared<N>(std::move(msg), std::move(edges));
  }
}

void record_refusal(const char* op, const std::vector<at::Tensor>& inputs,
                    std::initializer_list<const at::Tensor*> outputs) {
  torch::autograd::edge_list edges;
  for (const at::Tensor& t : inputs) {
    edges.push_back(t.defined() ? torch::autograd::impl::gradient_edge(t) : torch::autograd::Edge());
  }
  auto node = make_node<torch::autograd::Error>(
      std::string("blockdiag::") + op +
          " is one of simd's kernels and has no autograd: a gradient reached it through a graph that recorded "
          "it without simd's op or autograd Function around it; run simd through blockdiag (backend=\"simd\"), "
          "whose op differentiates it, or call it under torch.no_grad()",
      std::move(edges));
  for (const at::Tensor* out : outputs) {
    torch::autograd::set_history(*out, node);
  }
}

at::Tensor forward_autograd(c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
  const bool record =
      refuse_tangents_and_record("simd_native", {&x, &weight, bias.has_value() ? &*bias : nullptr});
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("blockdiag::simd_native", "")
                                 .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  at::Tensor y = handle.redispatch(keys & c10::after_autograd_keyset, x, weight, bias);
  if (record) {
    record_refusal("simd_native", {x, weight, bias.has_value() ? *bias : at::Tensor()}, {&y});
  }
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_autograd(c10::DispatchKeySet keys, const at::Tensor& gy,
                                                                 const at::Tensor& x, const at::Tensor& weight,
                                                                 bool has_bias, bool need_input, bool need_weight) {
  const bool record = refuse_tangents_and_record("simd_native_backward", {&gy, &x, &weight});
  static const auto handle =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("blockdiag::simd_native_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                                bool, bool, bool)>();
  auto out = handle.redispatch(keys & c10::after_autograd_keyset, gy, x, weight, has_bias, need_input, need_weight);
  if (record) {
    record_refusal("simd_native_backward", {gy, x, weight}, {&std::get<0>(out), &std::get<1>(out), &std::get<2>(out)});
  }
  return out;
}

}  // namespace

extern "C" {

// The version of the two functions below and of the ops' schemas; _simd_ops.py checks it.
int bd_ops_abi_version(void) { return 1; }

// Hands over the self-checked kernels of one dtype (0: float32, 1: float64). 0, or -1 for an
// unknown dtype index or a null kernel.
int bd_ops_set(int dtype, void* forward_kernel, void* grad_input_kernel, void* grad_weight_kernel) {
  if (dtype < 0 || dtype > 1 || forward_kernel == nullptr || grad_input_kernel == nullptr ||
      grad_weight_kernel == nullptr) {
    return -1;
  }
  Kernels& k = kernels[dtype];
  k.grad_input.store(reinterpret_cast<grad_input_fn>(grad_input_kernel));
  k.grad_weight.store(reinterpret_cast<grad_weight_fn>(grad_weight_kernel));
  k.forward.store(reinterpret_cast<forward_fn>(forward_kernel));
  return 0;
}

// Takes every dtype's kernels back: the ops refuse until bd_ops_set is called again.
void bd_ops_clear(void) {
  for (Kernels& k : kernels) {
    k.forward.store(nullptr);
  }
}

}  // extern "C"

TORCH_LIBRARY_FRAGMENT(blockdiag, m) {
  m.def("simd_native(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "simd_native_backward(Tensor grad, Tensor x, Tensor weight, bool has_bias, bool need_input, "
      "bool need_weight) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(blockdiag, CPU, m) {
  m.impl("simd_native", &forward);
  m.impl("simd_native_backward", &backward);
}

TORCH_LIBRARY_IMPL(blockdiag, Autograd, m) {
  m.impl("simd_native", torch::CppFunction::makeFromUnboxedFunction(TORCH_FN(forward_autograd)));
  m.impl("simd_native_backward", torch::CppFunction::makeFromUnboxedFunction(TORCH_FN(backward_autograd)));
}
