import pytest
import torch


@pytest.fixture(autouse=True)
def _full_fp32_precision():
    """Float32 convolutions and matmuls follow torch's TF32 switches (cuDNN's defaults to on), in the
    vd ops as in F.conv2d. Tests hold float32 results to float32 accuracy, so TF32 is off here."""
    cudnn, matmul = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = cudnn, matmul


@pytest.fixture
def one_thread():
    # Tiny tensors (gradcheck's thousands of calls, tiny models): starting a parallel region costs far
    # more than the work and stalls on a busy machine; the threaded paths are tested elsewhere.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
