"""URL slugs."""


def slugify(text):
    """Turn a title into a URL slug, e.g. "Hello, World!" -> "hello-world"."""
    raise NotImplementedError("slugify is not written yet")
