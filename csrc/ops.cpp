// The vd operator library: every schema is declared here, once.
// Backend files (csrc/cpu/*.cpp, csrc/cuda/*.cu) only hold TORCH_LIBRARY_IMPL blocks.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// Importing vdcompile._C runs the static registrations below; the module itself only says which
// arch-specific kernels the build carries (HOPPER_ATTENTION: the sm_90a kernels, attention's forward and the
// conv ops'; the name is older than the conv kernels).
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  PyObject* m = PyModule_Create(&module_def);
#if defined(VD_SM90A)
  const long hopper = 1;
#else
  const long hopper = 0;
#endif
  if (m != nullptr && PyModule_AddIntConstant(m, "HOPPER_ATTENTION", hopper) != 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
}

TORCH_LIBRARY(vd, m) {
  // Each family's fake kernels and autograd formulas live in vdcompile/ops/<family>.py (those of
  // group_norm_silu, temporal_conv and conv_bn_silu in csrc/autograd.cpp);
  // set_python_module applies to the defs that follow it.
  m.set_python_module("vdcompile.ops.attention");
  // softmax(q k^T * scale + mask) v over (B, H, L, D); returns (out, lse) where lse is the
  // log-sum-exp of the scaled, masked scores per query row, shape (B, H, Lq), float32 (float64 for
  // float64 inputs). compute_lse=False (inference) returns an empty (B, H, 0) lse, which spares the fp16 /
  // bf16 short-sequence CUDA kernels its writes; a backward then recomputes it.
  m.def("fused_attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, float? scale=None, "
        "bool compute_lse=True) -> (Tensor, Tensor)");
  m.def("fused_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
        "Tensor lse, Tensor? attn_mask, float? scale, Tensor? grad_lse) -> (Tensor, Tensor, Tensor)");

  // Attention restricted to keys 0, stride, 2*stride, ...; returns (out, lse) like fused_attention.
  m.def("strided_attention(Tensor q, Tensor k, Tensor v, int stride, float? scale=None)"
        " -> (Tensor, Tensor)");
  m.def("strided_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
        "Tensor lse, int stride, float? scale, Tensor? grad_lse) -> (Tensor, Tensor, Tensor)");

  m.set_python_module("vdcompile.ops.conv");
  // SiLU(BatchNorm_eval(conv2d(x))); silu=False gives conv + bn only.
  m.def("conv_bn_silu(Tensor x, Tensor weight, Tensor? bias, Tensor bn_weight, Tensor bn_bias, "
        "Tensor bn_mean, Tensor bn_var, float eps, int[2] stride, int[2] padding, int[2] dilation, "
        "int groups, bool silu=True) -> Tensor");
  // Returns the gradients of (x, weight, bias, bn_weight, bn_bias); grad of a missing bias is
  // still returned (shape (C_out,)) so the schema has no optional outputs.
  m.def("conv_bn_silu_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor? bias, "
        "Tensor bn_weight, Tensor bn_bias, Tensor bn_mean, Tensor bn_var, float eps, int[2] stride, "
        "int[2] padding, int[2] dilation, int groups, bool silu) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Inference calls reuse the BatchNorm fold while the parameters are unchanged; returns the cache's
  // [hits, misses, entries], then empties it and zeroes the counters if clear.
  m.def("conv_bn_silu_fold_cache(bool clear=False) -> int[]");
  // The same for the Winograd path's transformed weights (CUDA, Hopper; empty elsewhere).
  m.def("conv_bn_silu_winograd_cache(bool clear=False) -> int[]");

  m.set_python_module("vdcompile.ops.norm");
  // SiLU(GroupNorm(x)) for (N, C, *) with 1 to 3 trailing dims; silu=False gives GroupNorm only.
  // flexible_layout: inductor hands the op its inputs in the layout it chose (channels_last next to
  // its convolutions) instead of copying them back to the traced strides; the kernels read every
  // layout and answer by the rule in csrc/layout.h, which the fake kernel mirrors.
  m.def("group_norm_silu(Tensor x, int num_groups, Tensor? weight=None, Tensor? bias=None, "
        "float eps=1e-05, bool silu=True) -> Tensor",
        {at::Tag::flexible_layout});
  // The same, also returning the statistics the backward reads instead of computing them again: stats is
  // (3, N, num_groups) float32 (float64 for float64 x), the rows the mean's high part, its low part (the
  // mean is their sum) and rstd. What the op's autograd formula runs when a gradient is needed.
  m.def("group_norm_silu_forward(Tensor x, int num_groups, Tensor? weight=None, Tensor? bias=None, "
        "float eps=1e-05, bool silu=True) -> (Tensor, Tensor)",
        {at::Tag::flexible_layout});
  // Returns (grad_x, grad_weight, grad_bias); the latter two have shape (C,) and the dtype of
  // weight (of x when weight is None). stats: group_norm_silu_forward's, or None to compute them from x.
  m.def("group_norm_silu_backward(Tensor grad_out, Tensor x, int num_groups, Tensor? weight, "
        "Tensor? bias, float eps, bool silu, Tensor? stats=None) -> (Tensor, Tensor, Tensor)");

  m.set_python_module("vdcompile.ops.conv");
  // Conv3d with kernel (k, 1, 1), stride 1, over the frame axis of x (B, C, F, H, W).
  m.def("temporal_conv(Tensor x, Tensor weight, Tensor? bias=None, int padding=0) -> Tensor");
  // Returns (grad_x, grad_weight, grad_bias); grad_bias has shape (C_out,).
  m.def("temporal_conv_backward(Tensor grad_out, Tensor x, Tensor weight, int padding)"
        " -> (Tensor, Tensor, Tensor)");

  m.set_python_module("vdcompile.ops.scheduler");
  // One fused update of a diffusion sampler step (Euler, DDIM, DPM-Solver++(2M)):
  //   x0   = c_s * sample + c_m * model_output            (then clamped to +-clip_x0 if given)
  //   prev = d_s * sample + d_m * model_output + d_x0 * x0 + d_p * prev_x0
  //   prev = w * prev + (1 - w) * prev_frame              (if prev_frame and blend_weight given)
  // coeffs is (6,) or (N, 6) = [c_s, c_m, d_s, d_m, d_x0, d_p]; returns (prev_sample, x0).
  m.def("scheduler_step(Tensor model_output, Tensor sample, Tensor coeffs, Tensor? prev_x0=None, "
        "Tensor? prev_frame=None, Tensor? blend_weight=None, float? clip_x0=None) -> (Tensor, Tensor)");
}
