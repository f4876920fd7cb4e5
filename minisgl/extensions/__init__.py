"""Extensions: one package each, loaded by minisgl/extension_loader.py, registering what they
add with the registries the core defines. Removing a package leaves a core that runs."""
