"""The one table of verdict words: what each command calls its exit codes 0 (every check passed),
1 (a fault found) and 2 (nothing could be compared), in its JSON envelope and on the terminal."""

WORDS = {
    "check.mapping": ("consistent", "inconsistent", "skipped"),
    "check.sharding": ("consistent", "inconsistent", "skipped"),
    "verify": ("intact", "corrupted", "skipped"),
    "diff": ("same", "different", "skipped"),
}
DEFAULT = ("passed", "failed", "skipped")  # check dequant, check attention, the lone-file checks


def verdict_word(command: str, code: int) -> str:
    return WORDS.get(command, DEFAULT)[code]
