"""Writes a PyTorch memory snapshot recorded with PyTorch's default history settings (stacks and
context on), for `vramd replay`: each frame of such a snapshot is one object shared by every
traceback that holds it.

Usage: python3 scripts/h200/stacks_snapshot.py OUT.pickle
"""
import sys


def main():
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) == 2 else 2)
    import torch

    torch.cuda.memory._record_memory_history()
    keep = []
    for i in range(1, 60):
        keep.append(torch.empty(i << 20, dtype=torch.uint8, device="cuda"))
        if i % 3 == 0:
            keep.pop(0)
    y = torch.randn(1024, 1024, device="cuda") @ torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.memory._dump_snapshot(sys.argv[1])
    print(f"snapshot written to {sys.argv[1]}")
    del y, keep


if __name__ == "__main__":
    main()
