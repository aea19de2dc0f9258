"""Sweeps: a grid or list of normal gpulens runs, one subprocess per cell, resumable.

``spec`` parses and validates the YAML spec, ``cells`` expands it into hashed cells, ``state``
keeps one atomically written state file per cell, ``local`` and ``ray_executor`` run cells, and
``runner`` orchestrates (resume, retries, summary).
"""
