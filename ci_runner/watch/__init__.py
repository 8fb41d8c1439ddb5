"""Hooks and watches: module hooks and captures, what the backend compiled and ran, Dynamo traces."""
