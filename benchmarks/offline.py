"""Offline throughput of nanoserve against transformers' batched generate (see nanoserve/course/bench.py).

    python benchmarks/offline.py            # same as: python -m nanoserve bench
"""
from nanoserve.course.bench import main

if __name__ == "__main__":
    main()
