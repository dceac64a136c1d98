"""``dspark bench``: prompt suites, the methods compared, the built-in DFlash adapter, the three-pass runner,
the typed result and its report (Markdown and plots)."""
