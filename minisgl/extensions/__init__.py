"""Extensions: one package per production feature, each plugging into an interface the core
defines (minisgl/extension_loader.py loads them; docs/architecture.md lists them)."""
