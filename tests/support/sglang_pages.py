"""SGLang-shaped pages for the HiCache backend's tests: a host pool and page hashes' stand-ins.

``HostPool`` is a host KV pool in SGLang's ``page_first`` layout, with the three
page methods ``HostKVCache`` declares and the backend uses (``get_data_page``,
``get_dummy_flat_data_page``, ``set_from_flat_data_page``) and the attributes
it reads (``page_size``, ``layout``, ``dtype``). It exists because SGLang's own
host pools cannot be imported next to the CPU torch: ``sglang.srt.mem_cache.
pool_host`` imports the device memory pool, whose configs import
``torchvision.transforms``, and PyPI's torchvision needs CUDA torch
(``operator torchvision::nms does not exist``). The flat page is K then V of
the page's tokens, each ``(tokens, layers, heads, head_dim)``, as SGLang's
``page_first`` pool flattens it.

::

    kv_buffer  (2, slots, layers, heads, head_dim)      K = kv_buffer[0], V = kv_buffer[1]
    page at slot s:  kv_buffer[:, s : s + page_size]  ->  flat (2 * page_size * L * H * D,)
"""

from __future__ import annotations

import hashlib

import torch

PAGE_SIZE = 4
LAYERS = 2
HEADS = 2
HEAD_DIM = 8
PAGE_BYTES = 2 * PAGE_SIZE * LAYERS * HEADS * HEAD_DIM * 2  # bfloat16


class HostPool:
    """A ``page_first`` host pool of ``pages`` pages of bfloat16 KV; see the module docstring."""

    layout = "page_first"
    dtype = torch.bfloat16
    page_size = PAGE_SIZE

    def __init__(self, pages: int, seed: int | None = None) -> None:
        shape = (2, pages * PAGE_SIZE, LAYERS, HEADS, HEAD_DIM)
        if seed is None:
            self.kv_buffer = torch.zeros(shape, dtype=self.dtype)
        else:
            generator = torch.Generator().manual_seed(seed)
            self.kv_buffer = torch.randn(shape, generator=generator).to(self.dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, index : index + PAGE_SIZE]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros((2, PAGE_SIZE, LAYERS, HEADS, HEAD_DIM), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, index : index + PAGE_SIZE] = data_page.reshape(
            2, PAGE_SIZE, LAYERS, HEADS, HEAD_DIM
        )

    def slots(self, pages: range) -> torch.Tensor:
        """The host indices of ``pages``' tokens, as the controller passes them."""
        return torch.arange(pages.start * PAGE_SIZE, pages.stop * PAGE_SIZE, dtype=torch.int64)

    def page(self, page: int) -> torch.Tensor:
        return self.get_data_page(page * PAGE_SIZE)


def page_hashes(count: int, salt: str = "") -> list[str]:
    """Hex strings shaped like SGLang's page hashes (SHA-256), distinct per ``salt``."""
    return [hashlib.sha256(f"{salt}/{i}".encode()).hexdigest() for i in range(count)]


def random_pages(count: int, seed: int) -> list[torch.Tensor]:
    """``count`` flat bfloat16 pages of ``PAGE_BYTES`` bytes."""
    generator = torch.Generator().manual_seed(seed)
    numel = PAGE_BYTES // 2
    return [torch.randn(numel, generator=generator).to(torch.bfloat16) for _ in range(count)]
