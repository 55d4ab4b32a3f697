"""Host-side page allocator for the compressed-row pages (plain Python, no jax).

A page holds the compressed rows (and indexer keys) of `page_size` consecutive tokens of one
sequence, in every compressed layer at once; a sequence's block table lists its pages in
order. Reference counts let later features (prefix caching) share a page between sequences.
"""

from __future__ import annotations


class OutOfPagesError(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))   # pop() hands out page 0 first
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def refs(self, page: int) -> int:
        return self._refs[page]

    def share(self, page: int) -> None:
        if self._refs[page] <= 0:
            raise ValueError(f"page {page} is not allocated")
        self._refs[page] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} freed twice")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
