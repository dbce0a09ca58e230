"""The checkpoint family: ``checkpoint``, ``restore`` and ``retirement`` controllers (retire and
forget), the fan-out they share (``fanout``, ``open_calls``), the checkpoint roots and safe file
reads (``confined``), the publisher's files (``publish_files``), row and stage names (``names``),
and its routes (``api``). docs/checkpointing.md is the reference."""

__all__ = ["api", "checkpoint", "confined", "fanout", "names", "open_calls", "publish_files", "restore", "retirement"]
