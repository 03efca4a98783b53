"""The calculator task: questions a tiny model answers only through the tool, with its teacher,
reward and warm start.

``tool_calc``  data source and reward ``tool_calc``, the imperfect teacher's transcripts
``warmstart``  model builder ``tiny_tool_calc``: tokenizer, SFT on the teacher's transcripts, cached
"""
