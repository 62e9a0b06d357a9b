"""Packet parsers: one frozen dataclass per packet, grouped by family (connect, data, trace, ...).

Each class names its wire prefix and parses the bytes after it. Parsing is strict: a malformed packet raises
`PacketError`, which the dispatcher turns into an `E..` reply, so handlers only ever see well-formed requests.
"""
