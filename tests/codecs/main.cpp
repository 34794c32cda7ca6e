// tests/codecs/main.cpp — doctest's main for the codec tests.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
