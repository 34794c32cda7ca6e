// gact/tests/policy/main.cpp
//
// doctest entry point of the policy tests (records, solver, estimators, controller).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
