"""engine.demos.ports: ports a demo names before its servers bind them, picked where no outgoing
connection's local port can take them in between."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from engine.demos import ports
from engine.demos.ports import free_port


def test_picks_are_free_and_outside_the_ephemeral_range() -> None:
    low, high = ports.ephemeral_range()
    picked = {free_port() for _ in range(50)}
    assert all(ports.LOWEST <= p < 65536 and not low <= p <= high for p in picked), sorted(picked)
    assert len(picked) > 1  # random, not one fixed port
    for port in picked:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_port_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        # The only candidate is taken: the pick falls back to a port the kernel chooses.
        monkeypatch.setattr(ports, "candidates", lambda: [range(taken, taken + 1)])
        assert free_port() != taken


def test_the_kernel_default_range_when_the_setting_cannot_be_read(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", tmp_path / "absent")
    assert ports.ephemeral_range() == ports.DEFAULT_EPHEMERAL
    (tmp_path / "garbled").write_text("not numbers\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", tmp_path / "garbled")
    assert ports.ephemeral_range() == ports.DEFAULT_EPHEMERAL
    (tmp_path / "all").write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", tmp_path / "all")
    assert ports.candidates() == []  # nothing outside it: free_port asks the kernel
    assert 1024 <= free_port() <= 65535
