"""Task kinds for self-written requests (train/training/magpie.py, ``data.magpie.tasks``): what users of a chat
model ask for, each kind with a system prompt that describes such a user (Magpie's task-conditioned system
prompts, Xu et al. 2024) and openers that start the request.

Why openers: SmolLM2-135M given only a task's system prompt mostly ignores it (asked for translation requests, it
wrote stories); given the first words of a request it continues on the task. ``""`` among a kind's openers leaves
some requests wholly to the model. The kinds follow the categories chat benchmarks report (MT-bench's eight, plus
translation, summarization, question answering and answering from a given passage), so a drafter trained on the
data has seen each kind; the requests themselves are the model's own, never a benchmark's (the exclusion check).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    system: str                  # the system prompt the request is sampled under (describes the assistant's users)
    openers: tuple[str, ...]     # first words of a request; one is chosen per row, "" lets the model start


TASKS = {
    "writing": Task(
        "You are a writing assistant. Users ask you to write stories, poems, essays, letters, emails and blog posts "
        "on topics they choose.",
        ("Write a short story about", "Write a poem about", "Write an essay on", "Write a blog post about",
         "Write a formal email to", "")),
    "roleplay": Task(
        "You are an assistant that plays characters. Users ask you to take on a role or persona and answer in "
        "character.",
        ("Pretend you are", "Act as", "Imagine you are", "Role-play as", "You are a", "")),
    "reasoning": Task(
        "You are an assistant that solves logic puzzles and reasoning questions step by step.",
        ("Solve this riddle:", "If", "Explain step by step why", "There are three", "Which is heavier,", "")),
    "math": Task(
        "You are a math tutor. Users ask you arithmetic, algebra, geometry and word problems.",
        ("Solve for x:", "What is", "Calculate", "A store sells", "Find the area of", "How many")),
    "coding": Task(
        "You are a programming assistant. Users ask you to write, explain or fix code.",
        ("Write a Python function that", "How do I", "Fix this code:", "Write a JavaScript function that",
         "Explain what this code does:", "Write a SQL query that")),
    "extraction": Task(
        "You are an assistant that extracts information. Users paste a text and ask you to pull out names, dates, "
        "numbers or facts from it.",
        ("Extract all the names from the following text:", "From the text below, list", "Identify the dates in "
         "this passage:", "Find every number in this paragraph and say what it counts:", "")),
    "stem": Task(
        "You are a science and technology expert. Users ask questions about physics, chemistry, biology, medicine, "
        "engineering and computing.",
        ("Explain how", "What is the difference between", "Why does", "How do", "What causes", "")),
    "humanities": Task(
        "You are an expert in history, philosophy, literature, art and society. Users ask you questions about them.",
        ("What were the causes of", "Discuss the", "Who was", "Explain the significance of", "Compare", "")),
    "translation": Task(
        "You are a translator. Users give you a sentence or a paragraph and ask you to translate it into another "
        "language.",
        ("Translate the following sentence into French:", "Translate into Spanish:", "Translate this text to German:",
         "How do you say this in Italian:", "Translate to English:", "Translate the following into Chinese:")),
    "summarization": Task(
        "You are an assistant that summarizes. Users paste an article, a story or a report and ask for a summary.",
        ("Summarize the following article:", "Give a brief summary of this text:", "Summarize in one paragraph:",
         "What are the main points of this passage?", "TL;DR:")),
    "qa": Task(
        "You are a knowledgeable assistant. Users ask short factual questions.",
        ("What is", "Who", "When did", "Where is", "How many", "Why")),
    "rag": Task(
        "You are an assistant that answers questions from a given passage. Users paste a passage of background text, "
        "then ask a question to be answered from it.",
        ("Read the passage below and answer the question.\n\nPassage:", "Based on the following text, answer the "
         "question at the end.\n\n", "Context:", "Here is an article:")),
}


def check_tasks(tasks) -> list[str] | None:
    """``data.magpie.tasks`` as a list of known kinds (None or empty: no conditioning); an unknown one is named."""
    if not tasks:
        return None
    if isinstance(tasks, str):
        tasks = [tasks]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"data.magpie.tasks: unknown task kind(s) {unknown}; choose from {', '.join(TASKS)}")
    return list(tasks)


def opener(task: str | None, n: int) -> str:
    """The opener of request number ``n`` of ``task`` (none without a task), cycling through the kind's list."""
    if task is None:
        return ""
    openers = TASKS[task].openers
    return openers[n % len(openers)]
