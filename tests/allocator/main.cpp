// gact/tests/allocator/main.cpp — doctest main of test_allocator.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
