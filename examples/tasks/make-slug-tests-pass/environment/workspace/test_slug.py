import unittest

from slug import slugify


class SlugifyTest(unittest.TestCase):
    def test_words(self):
        self.assertEqual(slugify("Hello World"), "hello-world")

    def test_punctuation(self):
        self.assertEqual(slugify("Hello, World!"), "hello-world")

    def test_spaces_collapse(self):
        self.assertEqual(slugify("  many   spaces here "), "many-spaces-here")

    def test_digits(self):
        self.assertEqual(slugify("Python 3 rocks"), "python-3-rocks")


if __name__ == "__main__":
    unittest.main()
