import os

import crc32c
import pytest

from hma_redis.core import codec
from hma_redis.core.codec import (
    CRC_AT,
    MAC_AT,
    PREFIX_BYTES,
    BlockHeader,
    CorruptBlockError,
    ForeignKeyError,
    MacCheck,
    MacKey,
    check_seal,
    decode,
    encode,
)

KEY = "hma:abc:g0:00ff"


def _header(key=KEY, group=0, num_blocks=3, pages=(64, 32)):
    return BlockHeader(
        key=key, group=group, first_block=0, num_blocks=num_blocks, page_bytes=pages,
        kv_dtype="bfloat16",
    )  # fmt: skip


def _value(header=None):
    header = header or _header()
    body = os.urandom(header.body_bytes)
    return codec.encode(header, body), body


def test_round_trip_returns_zero_copy_views_of_every_layer():
    value, body = _value()
    raw = bytes(value)
    block = codec.decode(raw, expected_key=KEY, expected_group=0)
    assert bytes(block.body) == body
    assert bytes(block.layer(0)) == body[: 3 * 64]
    assert bytes(block.layer(1)) == body[3 * 64 :]
    assert block.body.obj is raw  # a view into the reply, not a copy


def test_encode_parts_is_the_same_value_without_joining_the_body():
    header = _header()
    body = memoryview(os.urandom(header.body_bytes))
    parts = codec.encode_parts(header, [body[:10], body[10:100], body[100:]])
    assert [p.obj for p in parts[1:]] == [body.obj] * 3  # the body's pieces, not copies
    assert b"".join(parts) == bytes(codec.encode(header, body))
    with pytest.raises(ValueError, match="body pieces hold 10 bytes"):
        codec.encode_parts(header, [body[:10]])


def test_encode_fills_body_in_place():
    header = _header()
    enc = codec.start_encode(header)
    enc.body[:] = b"\x07" * header.body_bytes
    value = enc.seal()
    assert value.nbytes == codec.value_size(header)
    assert bytes(codec.decode(value).body) == b"\x07" * header.body_bytes


def test_value_of_another_key_is_rejected():
    value, _ = _value(_header(key="hma:other:g0:00ff"))
    with pytest.raises(CorruptBlockError, match="belongs to key"):
        codec.decode(value, expected_key=KEY)


def test_value_of_another_group_is_rejected():
    value, _ = _value(_header(group=1))
    with pytest.raises(CorruptBlockError, match="group"):
        codec.decode(value, expected_key=KEY, expected_group=0)


def _mutate(value, offset, byte):
    raw = bytearray(value)
    raw[offset] ^= byte
    return bytes(raw)


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(lambda v: _mutate(v, len(v) - 1, 0x01), id="flipped-body-bit"),
        pytest.param(lambda v: _mutate(v, codec.PREFIX_BYTES + 2, 0x40), id="flipped-header"),
        pytest.param(lambda v: v[:-1], id="truncated-by-one"),
        pytest.param(lambda v: v[: len(v) // 2], id="truncated-half"),
        pytest.param(lambda v: v + b"\x00", id="extra-byte"),
        pytest.param(lambda v: v[:5], id="shorter-than-prefix"),
        pytest.param(lambda v: b"", id="empty"),
        pytest.param(lambda v: b"XXXX" + v[4:], id="bad-magic"),
        pytest.param(lambda v: v[:4] + b"\x00\x09" + v[6:], id="other-version"),
        pytest.param(lambda v: os.urandom(len(v)), id="garbage"),
        pytest.param(lambda v: v[:8] + b"\xff\xff\xff\xff" + v[12:], id="huge-header-length"),
        pytest.param(lambda v: v[:6] + b"\x00\x02" + v[8:], id="unknown-flag"),
    ],
)
def test_every_corruption_raises_corrupt_block_error(corrupt):
    value, _ = _value()
    with pytest.raises(CorruptBlockError):
        codec.decode(corrupt(bytes(value)), expected_key=KEY)


def test_header_that_lies_about_its_length_is_rejected():
    header = _header()
    body = os.urandom(header.body_bytes)
    # Build a valid envelope whose header claims one block more than the body holds.
    lying = BlockHeader(KEY, 0, 0, 4, header.page_bytes, "bfloat16")
    enc = codec.start_encode(lying)
    enc.body[: len(body)] = body
    value = bytes(enc.seal())[: -(sum(header.page_bytes))]
    with pytest.raises(CorruptBlockError):
        codec.decode(value, expected_key=KEY)


def test_decode_header_reports_checksum_state():
    value, _ = _value()
    header, ok = codec.decode_header(bytes(value))
    assert ok and header.key == KEY
    header, ok = codec.decode_header(_mutate(bytes(value), len(value) - 1, 1))
    assert not ok and header.num_blocks == 3


# ------------------------------------------------------------------ keyed MAC (auth_key)

SECRET = b"shared-secret-of-the-instances-0001"
MAC = MacKey.derive(SECRET)


def _forge(value: bytes, new_body: bytes) -> bytes:
    """What an attacker who can write to Redis and read this module does: replace the body and
    recompute the CRC32C (no secret needed for that)."""
    import crc32c

    header_len = int.from_bytes(value[8:12], "big")
    payload = value[codec.PREFIX_BYTES : codec.PREFIX_BYTES + header_len] + new_body
    crc = crc32c.crc32c(payload).to_bytes(4, "big")
    return value[:12] + crc + value[16 : codec.PREFIX_BYTES] + payload


def test_keyed_value_round_trips_through_every_encoder():
    header = _header()
    body = memoryview(os.urandom(header.body_bytes))
    whole = bytes(codec.encode(header, body, MAC))
    # In place, the MAC computed piece by piece over the pages, nothing copied.
    parts = codec.encode_parts(header, [body[:10], body[10:100], body[100:]], MAC)
    assert [p.obj for p in parts[1:]] == [body.obj] * 3
    assert b"".join(parts) == whole
    block = codec.start_encode(header, mac_key=MAC)
    block.body[:] = body
    assert bytes(block.seal()) == whole
    # The MAC field is always there: a value's size does not depend on the key.
    assert len(whole) == codec.value_size(header) == len(bytes(codec.encode(header, body)))
    assert codec.has_mac(whole) and not codec.has_mac(bytes(codec.encode(header, body)))
    assert bytes(codec.decode(whole, expected_key=KEY, mac_key=MAC).body) == bytes(body)


def test_forged_body_with_valid_crc_passes_unkeyed_reader_but_not_keyed_one():
    header = _header()
    plain = bytes(codec.encode(header, os.urandom(header.body_bytes)))
    evil = os.urandom(header.body_bytes)
    # CRC32C and the key echo stop accidents only: an unkeyed reader takes the forged value.
    assert bytes(codec.decode(_forge(plain, evil), expected_key=KEY).body) == evil
    keyed = bytes(codec.encode(header, os.urandom(header.body_bytes), MAC))
    with pytest.raises(CorruptBlockError, match="MAC mismatch"):
        codec.decode(_forge(keyed, evil), expected_key=KEY, mac_key=MAC)


def test_check_mac_compares_the_mac_whatever_else_is_wrong():
    header = _header()
    keyed = bytearray(codec.encode(header, os.urandom(header.body_bytes), MAC))
    assert codec.check_mac(keyed, MAC) is codec.MacCheck.OK
    assert codec.check_mac(keyed, None) is codec.MacCheck.UNCHECKED
    assert codec.check_mac(keyed, MacKey.derive(b"another-secret-0123456789")) is (
        codec.MacCheck.BAD
    )
    crc_only = bytearray(keyed)
    crc_only[12] ^= 1  # decode stops at the checksum; the MAC still holds
    assert codec.check_mac(crc_only, MAC) is codec.MacCheck.OK
    body = bytearray(keyed)
    body[-1] ^= 1
    assert codec.check_mac(body, MAC) is codec.MacCheck.BAD
    plain = bytes(codec.encode(header, os.urandom(header.body_bytes)))
    assert codec.check_mac(plain, MAC) is codec.MacCheck.ABSENT
    assert codec.check_mac(keyed[: codec.PREFIX_BYTES - 1], MAC) is codec.MacCheck.UNREADABLE


@pytest.mark.parametrize(
    ("writer", "reader", "message"),
    [
        pytest.param(None, MAC, "has no MAC", id="unkeyed-value-keyed-reader"),
        pytest.param(MAC, None, "this reader has none", id="keyed-value-unkeyed-reader"),
        pytest.param(MacKey.derive(b"another-secret-0123456789"), MAC, "MAC mismatch",
                     id="other-key"),
    ],
)  # fmt: skip
def test_value_without_a_valid_mac_for_the_reader_is_corrupt(writer, reader, message):
    header = _header()
    value = bytes(codec.encode(header, os.urandom(header.body_bytes), writer))
    with pytest.raises(CorruptBlockError, match=message):
        codec.decode(value, expected_key=KEY, mac_key=reader)


def test_stripping_the_mac_flag_does_not_fool_a_keyed_reader():
    header = _header()
    value = bytearray(codec.encode(header, os.urandom(header.body_bytes), MAC))
    value[6:8] = b"\x00\x00"  # flags: "no MAC"
    value[16 : codec.PREFIX_BYTES] = bytes(codec.MAC_BYTES)
    with pytest.raises(CorruptBlockError):
        codec.decode(bytes(value), expected_key=KEY, mac_key=MAC)


@pytest.mark.parametrize("offset", [0, 4, 6, 9, codec.PREFIX_BYTES + 3, -1])
def test_any_changed_byte_of_a_keyed_value_is_corrupt(offset):
    header = _header()
    value = bytes(codec.encode(header, os.urandom(header.body_bytes), MAC))
    with pytest.raises(CorruptBlockError):
        codec.decode(_mutate(value, offset % len(value), 0x10), expected_key=KEY, mac_key=MAC)


def test_mac_key_hides_its_bytes():
    assert MAC.key.hex() not in repr(MAC) and SECRET.decode() not in repr(MAC)
    assert MacKey.derive(SECRET) == MAC and MacKey.derive(SECRET + b"x") != MAC


def test_header_carries_kv_cache_layout():
    header = BlockHeader(KEY, 0, 0, 3, (64, 32), "bfloat16", "HND")
    value = codec.encode(header, os.urandom(header.body_bytes))
    assert codec.decode(value, expected_key=KEY).header.kv_cache_layout == "HND"
    assert codec.decode_header(bytes(value))[0] == header


def test_prefix_offsets_and_head_helpers_match_what_encode_writes():
    """The offsets and helpers the transfer engine and the twin use (codec.HEADER_LEN_AT,
    CRC_AT, MAC_AT, signed_prefix, value_mac, head_without_crc, head_mac_matches) describe the
    value encode() writes, byte for byte: the envelope is laid out in one place."""
    key = MacKey.derive(b"k" * 32)
    header = _header()
    body = os.urandom(header.body_bytes)
    value = bytes(codec.encode(header, body, mac_key=key))
    packed = header.to_msgpack()
    signed = codec.signed_prefix(len(packed), key)
    assert value[: len(signed)] == signed
    assert int.from_bytes(value[codec.HEADER_LEN_AT : codec.CRC_AT], "big") == len(packed)
    crc = int.from_bytes(value[codec.CRC_AT : codec.MAC_AT], "big")
    assert crc == crc32c.crc32c(value[codec.PREFIX_BYTES :])
    mac = codec.value_mac(key, [body[:10], body[10:]], packed, signed)
    assert value[codec.MAC_AT : codec.PREFIX_BYTES] == mac
    head = codec.head_without_crc(signed, packed, mac)
    assert bytes(head) == value[: codec.CRC_AT] + bytes(4) + value[codec.MAC_AT : len(head)]
    assert codec.head_mac_matches(head, (memoryview(body),), key)
    # A body in pieces (the pages a value landed in) has the MAC of the pieces joined.
    assert codec.head_mac_matches(head, (memoryview(body)[:7], memoryview(body)[7:]), key)
    assert not codec.head_mac_matches(head, (memoryview(body[:-1] + b"\0"),), key)
    assert not codec.head_mac_matches(head, (memoryview(body),), MacKey.derive(b"o" * 32))


# ---------------------------------------------------------------- sealed values


def _sealed_header() -> BlockHeader:
    return BlockHeader(
        key="hma:ns:g0:ab", group=0, first_block=0, num_blocks=2, page_bytes=(64, 32)
    )


def test_a_sealed_value_decodes_only_with_a_key_it_was_sealed_with() -> None:
    """The write key and a previous key open it; another key is a ForeignKeyError (no key of
    that id here), a reader without keys and a MAC reader refuse it."""
    from hma_redis.core.sealing import Keyring

    body = os.urandom(_sealed_header().body_bytes)
    value = bytes(encode(_sealed_header(), body, keyring=Keyring.from_secrets(b"k" * 32)))
    assert body not in value
    for ring in (Keyring.from_secrets(b"k" * 32), Keyring.from_secrets(b"n" * 32, b"k" * 32)):
        assert bytes(decode(value, "hma:ns:g0:ab", 0, keyring=ring).body) == body
    with pytest.raises(ForeignKeyError):
        decode(value, "hma:ns:g0:ab", 0, keyring=Keyring.from_secrets(b"n" * 32))
    with pytest.raises(CorruptBlockError, match="encrypted"):
        decode(value, "hma:ns:g0:ab", 0)
    with pytest.raises(CorruptBlockError, match="encrypted"):
        decode(value, "hma:ns:g0:ab", 0, mac_key=MacKey.derive(b"k" * 32))
    plain = bytes(encode(_sealed_header(), body))
    with pytest.raises(CorruptBlockError, match="not encrypted"):
        decode(plain, "hma:ns:g0:ab", 0, keyring=Keyring.from_secrets(b"k" * 32))


@pytest.mark.parametrize("where", ["signed-prefix", "header", "body", "tag", "nonce"])
def test_every_byte_a_sealed_value_authenticates_is_checked(where: str) -> None:
    """A change to the prefix's signed fields (here: the MAC flag added), the header (the
    associated data), the body, the tag or the nonce, CRC32C fixed, fails decryption."""
    from hma_redis.core.sealing import Keyring

    ring = Keyring.from_secrets(b"k" * 32)
    value = bytearray(
        encode(_sealed_header(), os.urandom(_sealed_header().body_bytes), keyring=ring)
    )
    at = {
        "signed-prefix": 4,
        "header": PREFIX_BYTES + 3,
        "body": len(value) - 1,
        "tag": MAC_AT,
        "nonce": PREFIX_BYTES - 1,
    }[where]
    value[at] ^= 0x01
    value[CRC_AT : CRC_AT + 4] = crc32c.crc32c(bytes(value[PREFIX_BYTES:])).to_bytes(4, "big")
    with pytest.raises(CorruptBlockError):
        decode(bytes(value), "hma:ns:g0:ab", 0, keyring=ring)
    assert check_seal(bytes(value), ring) in (MacCheck.BAD, MacCheck.UNREADABLE)


def test_check_seal_reports_each_state() -> None:
    from hma_redis.core.sealing import Keyring

    ring = Keyring.from_secrets(b"k" * 32)
    body = os.urandom(_sealed_header().body_bytes)
    sealed = bytes(encode(_sealed_header(), body, keyring=ring))
    assert check_seal(sealed, ring) is MacCheck.OK
    assert check_seal(sealed, None) is MacCheck.UNCHECKED
    assert check_seal(sealed, Keyring.from_secrets(b"n" * 32)) is MacCheck.UNCHECKED
    assert check_seal(bytes(encode(_sealed_header(), body)), ring) is MacCheck.ABSENT
    assert check_seal(b"short", ring) is MacCheck.UNREADABLE


@pytest.mark.parametrize("key_id", ["", "k1-0123abcd"])
@pytest.mark.parametrize("key_len", [0, 1, 31, 32, 255, 256, 65535, 65536])
def test_header_template_packs_the_bytes_of_the_header_with_that_key(key_id, key_len):
    """The oracle is the header's own msgpack: every msgpack string size class of the key
    (fixstr, str8, str16, str32), with and without a key id, non-ASCII keys, large fields."""
    import random
    from dataclasses import replace

    rng = random.Random(key_len)
    shape = BlockHeader(
        key="", group=rng.randrange(1 << 20), first_block=rng.randrange(64),
        num_blocks=rng.randrange(1, 65), page_bytes=(16384, 1 << 40, 3),
        kv_dtype="fp8_e4m3", kv_cache_layout="HND", key_id=key_id,
    )  # fmt: skip
    template = codec.HeaderTemplate(shape)
    for key in ("x" * key_len, ("é" * key_len)[:key_len], "hma:ns:g0:" + "ab" * 16):
        assert template.pack(key) == replace(shape, key=key).to_msgpack()
    assert template.header is shape


def test_a_header_template_refuses_a_header_it_cannot_cut():
    """More fields than a fixmap holds would change the map's first bytes: refused, not
    packed wrong."""

    class Wide(BlockHeader):
        def _fields(self):
            fields = super()._fields()
            fields.update({f"x{i}": i for i in range(10)})
            return fields

    with pytest.raises(ValueError, match="at most 15 fields"):
        codec.HeaderTemplate(Wide(key="", group=0, first_block=0, num_blocks=1, page_bytes=(8,)))
