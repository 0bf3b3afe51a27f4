"""Reference models built only from purejax: each file a config, an `init` and an `apply`."""
