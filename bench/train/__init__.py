"""The reference trainer, ``python -m bench.train``: a small GPT on synthetic tokens, its command line, run summary, model, FSDP2 and
parallel layouts, and the torch.distributed plumbing other benchmarks borrow.

The command is ``_main``; ``__main__`` runs it.
"""
