"""Tests that start no server: pure logic, the in-memory store, static checks."""
