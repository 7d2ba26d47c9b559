"""Tests of the package as installed and of ci/'s scripts (the wheel's contents, the GPU check's dry
run).
"""
