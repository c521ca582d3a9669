"""The command line: ``python -m mpizero {example,verify,train,estimate,plot,consolidate}``."""
