"""Cross-process contracts that are not protobuf: vocabularies every side of kvpush speaks."""
