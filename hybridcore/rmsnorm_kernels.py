"""The Triton kernels of hybridcore/rmsnorm.py (imported on first use: a CPU install may have no triton). One program
normalises one row of H elements (H <= BLOCK, a power of two) in float32."""
import triton
import triton.language as tl


@triton.jit
def rms_forward(x_ptr, w_ptr, y_ptr, rstd_ptr, stride_x, stride_y, H, eps, BLOCK: tl.constexpr):
    """y = w * (x * rstd) rounded to x's dtype first, rstd = 1 / sqrt(mean(x^2) + eps), as LlamaRMSNorm computes it:
    the product of the two rounded factors in float32 (exact for 16-bit ones), rounded once to y's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=ok)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def rms_backward(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, stride_dy, stride_x, stride_dx, H, BLOCK: tl.constexpr):
    """dx = rstd * g - x * rstd^3 * sum(g * x) / H with g = dy * w (the gradient of x * rstd), in float32; the
    rounding to x's dtype in forward passes the gradient through, as autograd's cast does."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    g = (tl.load(dy_ptr + row * stride_dy + cols, mask=ok, other=0.0).to(tl.float32)
         * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32))
    rstd = tl.load(rstd_ptr + row)
    dx = rstd * g - x * (rstd * rstd * rstd * tl.sum(g * x, axis=0) / H)
    tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=ok)
