import unittest

from slug import slugify


class HiddenSlugifyTest(unittest.TestCase):
    def test_hyphens_and_underscores(self):
        self.assertEqual(slugify("snake_case and-kebab"), "snake-case-and-kebab")

    def test_only_symbols(self):
        self.assertEqual(slugify("!!!"), "")

    def test_mixed_case(self):
        self.assertEqual(slugify("ARES Gateway v2"), "ares-gateway-v2")
