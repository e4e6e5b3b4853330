"""Diagnostics: the host-sync profiler (`host_syncs`), test helpers (`testing`) and plotting (`plot`, needs matplotlib)."""
