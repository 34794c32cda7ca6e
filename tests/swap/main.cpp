// gact/tests/swap/main.cpp — doctest main of the swap tests.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
